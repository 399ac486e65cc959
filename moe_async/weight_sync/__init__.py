"""moe_async.weight_sync"""
