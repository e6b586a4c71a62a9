"""A request's team, for the per-team figures and the usage limits: the scope of its
API key (proxy/auth.py), or `other` (no key, or a key without a scope)."""

from __future__ import annotations

OTHER_TEAM = "other"


def teams(keys: dict[str, str | None]) -> list[str]:
    """Every team: the configured scopes, and `other`. Scopes come from the settings
    alone, so the set is bounded, fit for metric labels."""
    return sorted({scope for scope in keys.values() if scope}) + [OTHER_TEAM]


def team_of(scope: str | None) -> str:
    return scope or OTHER_TEAM
