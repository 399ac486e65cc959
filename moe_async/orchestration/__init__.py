"""moe_async.orchestration"""
