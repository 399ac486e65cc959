"""moe_async.replay"""
