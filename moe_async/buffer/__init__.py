"""moe_async.buffer"""
