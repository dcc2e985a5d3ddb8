"""Multi-turn rollouts with tools: tool interface and config (tools), tool worker processes (runner),
Hermes calls and chat-template tokens (chat), the turn loop over any rollout engine (rollout)."""
