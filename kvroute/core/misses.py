"""Why a request's prompt was, or was not, served from a prompt cache: the closed set of
reasons that backends and proxies report, and the headers that carry them.

A backend decides what its store knows (what it holds, held and evicted, or refused to
keep); the proxy combines that with what it knows of the routing (what the registry
predicted, where it routed and why, whether the lookup answered in time) into the one
reason the client sees in `x-kvroute-cache-reason` (kvroute/proxy/misses.py).
docs/dashboard.md says what each reason calls for.
"""

from __future__ import annotations

# Served as well as the caches could: the prompt's uncached part was new to them.
HIT = "hit"
NEW_PREFIX = "new_prefix"  # nothing beyond the template's opening was ever cached
# Decided by the backend, from its store:
EVICTED_RAM = "evicted_ram"  # an entry holding more was evicted for the RAM budget
EVICTED_DISK = "evicted_disk"  # ... and its disk tier no longer holds it either
NO_CHECKPOINT = "no_checkpoint"  # an untrimmable entry holds more, with no checkpoint here
TOO_LARGE = "too_large"  # the entry was over the budgets: kept in part, or refused
OTHER_SCOPE = "other_scope"  # another cache scope (team) holds more of it
# Decided by the proxy, from the routing:
ROUTED_FOR_LOAD = "routed_for_load"  # another backend held more; this one cost less
TEMPLATE_DRIFT = "template_drift"  # the keys matched, the tokens did not (prediction miss)
BACKEND_RESTARTED = "backend_restarted"  # the backend holding it restarted since
BACKEND_GONE = "backend_gone"  # the backend holding it stopped, or failed this request
LOOKUP_LATE = "lookup_late"  # the registry lookup missed its deadline: routed blind
REGISTRY_DOWN = "registry_down"  # Redis did not answer: routed blind

BACKEND_REASONS = (HIT, NEW_PREFIX, EVICTED_RAM, EVICTED_DISK, NO_CHECKPOINT, TOO_LARGE,
                   OTHER_SCOPE)
REASONS = BACKEND_REASONS + (ROUTED_FOR_LOAD, TEMPLATE_DRIFT, BACKEND_RESTARTED, BACKEND_GONE,
                             LOOKUP_LATE, REGISTRY_DOWN)

# Backend -> proxy: its own reason, the tokens that reason lost (prefilled although
# some store entry held or had held them), and the token position where the prompt
# leaves the entry holding its deepest advertised prefix key. Proxy -> client: the
# final reason, and the position when the reason is template drift.
REASON_HEADER = "x-kvroute-cache-reason"
LOST_HEADER = "x-kvroute-lost-tokens"
DIVERGED_HEADER = "x-kvroute-diverged-at"

# A cause that would have served fewer tokens than this explains nothing worth a
# reason (two conversations sharing a few words); below it, the request is a hit or new.
MIN_LOST_TOKENS = 16
