"""moe_async.rollout"""
