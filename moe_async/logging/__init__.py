"""moe_async.logging"""
