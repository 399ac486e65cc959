"""moe_async.compat"""
