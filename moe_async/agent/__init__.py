"""Multi-turn agentic rollouts: environments, tools, token-in/token-out trajectories."""
