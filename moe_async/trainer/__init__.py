"""moe_async.trainer"""
