"""moe_async.models"""
