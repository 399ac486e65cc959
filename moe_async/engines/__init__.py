"""moe_async.engines"""
