"""Placeholder while the router lands."""
class AgentRouter:  # pragma: no cover
    pass
