"""A backend's cache reasons (kvroute/backend/misses.py) from the real store, real mlx-lm
caches and a real disk tier: what the store holds, held, and would not keep."""

from __future__ import annotations

import mlx.core as mx
from tests.harness import wait_until
from tests.test_disk import make_cache as grown_cache
from tests.test_disk import make_tier
from tests.test_store import make_window_cache, tokens

from kvroute.backend.metrics import BackendMetrics
from kvroute.backend.misses import Misses, view_headers
from kvroute.backend.store import Store, cache_nbytes, prefix_cache
from kvroute.core import misses as reasons
from kvroute.proxy.misses import Facts, client_reason
from kvroute.proxy.misses import explain as combine


def make_cache(n: int) -> list:
    """A state of exactly `n` tokens' bytes (mlx-lm's caches grow 256 tokens at a time)."""
    cache = prefix_cache(grown_cache(n), n)
    mx.eval([c.state for c in cache])
    return cache


PER_TOKEN = cache_nbytes(make_cache(1))


def setup(budget_tokens: int = 1000, opening: int = 3, disk=None) -> tuple[Store, Misses, BackendMetrics]:
    store = Store(budget_bytes=budget_tokens * PER_TOKEN)
    metrics = BackendMetrics("m", "b")
    return store, Misses(store, metrics, disk, opening), metrics


def explain(misses: Misses, store: Store, prompt: list[int], scope=None, chain=(0,)):
    hit = store.lookup("m", prompt, scope)
    return misses.explain("m", prompt, scope, list(chain), hit.tokens, prefill_tps=1000.0), hit.tokens


def test_a_new_prompt_and_a_hit():
    store, misses, metrics = setup()
    view, cached = explain(misses, store, tokens(100))
    assert (view.reason, view.lost, cached) == (reasons.NEW_PREFIX, 0, 0)
    store.insert("m", tokens(100), make_cache(100), "finish", chain=[0, 7, 8])
    view, cached = explain(misses, store, tokens(120), chain=[0, 7, 8, 9])
    assert (view.reason, view.lost, cached) == (reasons.HIT, 0, 100)
    assert view.diverged_at == 100  # where the prompt leaves the entry holding key 8
    # Only the template's opening in common: new, not a hit.
    view, cached = explain(misses, store, tokens(2) + tokens(50, 500))
    assert (view.reason, cached) == (reasons.NEW_PREFIX, 2)
    assert metrics.cache_reasons.labels(model="m", backend="b", reason="hit")._value.get() == 1
    assert view_headers(view) == {reasons.REASON_HEADER: "new_prefix", reasons.LOST_HEADER: "0"}


# Budgets under 132 tokens (100 + one 32-token block) let the next 100-token entry in
# only by freeing all of the first: eviction cuts an entry back from its tail, block by
# block, and removes it once nothing of it is left.


def test_an_evicted_entry_is_remembered_by_its_tokens():
    store, misses, metrics = setup(budget_tokens=120)
    store.insert("m", tokens(100), make_cache(100), "finish")
    store.insert("m", tokens(100, 1000), make_cache(100), "finish")  # evicts the first
    assert len(store) == 1
    view, cached = explain(misses, store, tokens(110))
    assert (view.reason, view.lost, cached) == (reasons.EVICTED_RAM, 100, 0)
    lost = metrics.seconds_lost.labels(model="m", backend="b", reason="evicted_ram")._value.get()
    assert lost == 100 / 1000.0
    # Another scope never learns of it; a few tokens in common explain nothing.
    assert explain(misses, store, tokens(110), scope="b")[0].reason == reasons.NEW_PREFIX
    assert explain(misses, store, tokens(10) + tokens(50, 600))[0].reason == reasons.NEW_PREFIX


def test_a_tail_cut_off_is_remembered_and_the_rest_still_hits():
    store, misses, _ = setup(budget_tokens=150)
    store.insert("m", tokens(100), make_cache(100), "finish")
    store.insert("m", tokens(100, 1000), make_cache(100), "finish")  # cuts the first to 32
    assert len(store) == 2
    view, cached = explain(misses, store, tokens(110))
    assert (view.reason, view.lost, cached) == (reasons.EVICTED_RAM, 68, 32)


def test_what_remembered_is_bounded_in_tokens():
    store, misses, _ = setup(budget_tokens=150)
    misses.keep_tokens = 250
    for i in range(5):
        store.insert("m", tokens(100, 1000 * i), make_cache(100), "finish")
    assert sum(len(g.tokens) for g in misses._gone) <= 250
    assert explain(misses, store, tokens(101))[0].reason == reasons.NEW_PREFIX  # forgotten
    assert explain(misses, store, tokens(101, 3000))[0].reason == reasons.EVICTED_RAM


def test_evicted_from_ram_and_from_the_disk_tier(tmp_path):
    for disk_files, reason in ((2, reasons.NEW_PREFIX), (1, reasons.EVICTED_DISK)):
        tier, _ = make_tier(tmp_path / str(disk_files),
                            budget=cache_nbytes(make_cache(100)) * (disk_files + 0.5))
        store, misses, _ = setup(budget_tokens=120, disk=tier)
        store.listeners.append(tier.on_store_event)
        store.insert("m", tokens(100), make_cache(100), "finish")
        wait_until(lambda: len(tier.index) == 1, 30, what="the first written")
        store.insert("m", tokens(100, 1000), make_cache(100), "finish")  # evicts it from RAM
        wait_until(lambda: [r.tokens[0] for r in tier.index.values()][-1:] == [1000], 30,
                   what="the second written")
        assert len(tier.index) == disk_files
        # Still on disk: a restore serves it (or a prefill chosen over it), nothing lost.
        view, _ = explain(misses, store, tokens(110))
        assert (view.reason, view.lost) == (reason, 0 if disk_files == 2 else 100)
        tier.close()


def test_an_entry_over_the_budget_is_too_large():
    store, misses, _ = setup(budget_tokens=40)
    prompt = tokens(100)
    done = store.commit("m", prompt, make_cache(100), "checkpoint")
    misses.on_commit(done, prompt, "m", None)
    assert done.kept == 40
    view, cached = explain(misses, store, tokens(101))
    assert (view.reason, view.lost, cached) == (reasons.TOO_LARGE, 60, 40)


def test_an_untrimmable_entry_without_a_checkpoint_here():
    store, misses, _ = setup()
    store.insert("m", tokens(60), make_window_cache(60), "finish")
    # Extends it: served. Leaves it at 50: the window cannot be cut back.
    assert explain(misses, store, tokens(70))[0].reason == reasons.HIT
    view, cached = explain(misses, store, tokens(50) + [999, 998])
    assert (view.reason, view.lost, cached) == (reasons.NO_CHECKPOINT, 50, 0)


def test_another_scope_holds_it():
    store, misses, _ = setup()
    store.insert("m", tokens(100), make_cache(100), "finish", scope="team-a")
    view, cached = explain(misses, store, tokens(120), scope="team-b")
    assert (view.reason, view.lost, cached) == (reasons.OTHER_SCOPE, 100, 0)
    assert explain(misses, store, tokens(120), scope="team-a")[0].reason == reasons.HIT


def test_the_largest_loss_names_the_reason():
    store, misses, _ = setup(budget_tokens=120)
    store.insert("m", tokens(40), make_cache(40), "finish", scope="b")
    store.insert("m", tokens(100), make_cache(100), "finish")
    store.insert("m", tokens(100, 1000), make_cache(100), "finish")  # evicts the 100
    view, _ = explain(misses, store, tokens(110))
    assert (view.reason, view.lost) == (reasons.EVICTED_RAM, 100)  # not other_scope (40)


# -- the proxy: the backend's view and the routing's facts, one reason ---------------



def test_the_backends_own_reason_stands_when_the_routing_explains_nothing():
    assert combine(Facts(cached=80, backend_reason="hit")).reason == "hit"
    assert combine(Facts(cached=0, backend_reason="new_prefix")).reason == "new_prefix"
    miss = combine(Facts(cached=0, backend_reason="evicted_ram", backend_lost=300))
    assert (miss.reason, miss.lost) == ("evicted_ram", 300)


def test_keys_that_matched_where_the_tokens_did_not_are_template_drift():
    miss = combine(Facts(cached=4, backend_reason="new_prefix", diverged_at=4, predicted=200))
    assert (miss.reason, miss.lost, miss.diverged_at) == ("template_drift", 196, 4)
    # Most of the prediction served: a hit (the prediction is an estimate).
    assert combine(Facts(cached=150, backend_reason="hit", predicted=200)).reason == "hit"
    # The backend knows better: its entry was evicted after it was advertised.
    assert combine(Facts(cached=4, backend_reason="evicted_ram", backend_lost=190,
                         predicted=200)).reason == "evicted_ram"


def test_a_deeper_prefix_elsewhere_is_routed_for_load_or_a_backend_gone():
    facts = Facts(cached=3, backend_reason="new_prefix", elsewhere=400.0)
    assert combine(facts).reason == "routed_for_load"
    gone = Facts(cached=3, backend_reason="new_prefix", elsewhere=400.0, elsewhere_failed=True)
    assert (combine(gone).reason, combine(gone).lost) == ("backend_gone", 397)


def test_a_conversation_whose_backend_restarted_or_went():
    for previous, reason in (("restarted", "backend_restarted"), ("gone", "backend_gone")):
        miss = combine(Facts(cached=3, backend_reason="new_prefix", previous=previous,
                             previous_tokens=250.0))
        assert (miss.reason, miss.lost) == (reason, 247)


def test_a_blind_route_explains_what_nothing_else_does():
    assert combine(Facts(cached=0, backend_reason="new_prefix", lookup="late")).reason == "lookup_late"
    assert combine(Facts(cached=0, backend_reason="new_prefix", lookup="down")).reason == "registry_down"
    assert combine(Facts(cached=90, backend_reason="hit", lookup="late")).reason == "hit"


def test_another_scope_is_told_to_operators_only():
    miss = combine(Facts(cached=0, backend_reason="other_scope", backend_lost=120))
    assert miss.reason == "other_scope"
    assert client_reason(miss.reason) == "new_prefix"
    assert client_reason("evicted_ram") == "evicted_ram"
