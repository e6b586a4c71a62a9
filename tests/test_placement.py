"""Cache-aware placement (proxy/policy/placement.py) over costs (proxy/policy/cost.py)."""

from kvroute.proxy.policy.cost import CostInput, cost
from kvroute.proxy.policy.placement import Option, Placer


def opt(prompt=1000, matched=0, free=0.0, load=0, key="", **kw) -> Option:
    c = cost(CostInput(prompt_tokens=prompt, matched_tokens=matched, prefill_tps=1000, **kw))
    return Option(c, matched, free, load, key)


def test_new_prefixes_go_where_the_most_cache_is_free():
    p = Placer(slack=1.0)
    assert p.place([opt(free=0.5), opt(free=0.9)]) == 1
    # Differences within one step of the budget say nothing (records lag a heartbeat):
    # rotation in backend order, advancing only on such ties, alternates.
    picks = [p.place([opt(free=0.91, key="a"), opt(free=0.93, key="b")]) for _ in range(4)]
    assert picks in ([0, 1, 0, 1], [1, 0, 1, 0])
    # Whatever order the candidates come in, the backends alternate.
    chosen = []
    for order in (["a", "b"], ["b", "a"], ["a", "b"], ["b", "a"]):
        chosen.append(order[p.place([opt(key=k) for k in order])])
    assert chosen in (["a", "b", "a", "b"], ["b", "a", "b", "a"])
    # Then load.
    assert p.place([opt(free=0.5, load=3), opt(free=0.52, load=1)]) == 1


def test_a_cached_prefix_keeps_its_backend_within_slack():
    p = Placer(slack=1.0)
    # The holder has some queued work, still cheaper than re-prefilling elsewhere.
    holder = opt(prompt=2000, matched=1800, queued_tokens=500)
    assert p.place([opt(prompt=2000, free=1.0), holder]) == 1
    # Far too busy: the request goes elsewhere.
    swamped = opt(prompt=2000, matched=1800, queued_tokens=5000)
    assert p.place([opt(prompt=2000), swamped]) == 0


def test_a_backend_full_of_decodes_loses_new_prefixes():
    p = Placer(slack=1.0)
    busy = opt(free=1.0, max_batch=8, decoding=8, decode_steps_per_s=20, reply_tokens=200)
    idle = opt(free=0.1, max_batch=8)
    for _ in range(4):
        assert p.place([busy, idle]) == 1


def test_small_rate_differences_do_not_decide():
    # Costs within the tie window count as equal: free cache decides.
    p = Placer(slack=1.0)
    a = Option(cost(CostInput(prompt_tokens=1000, prefill_tps=1050)), 0, 0.1, 0)
    b = Option(cost(CostInput(prompt_tokens=1000, prefill_tps=1000)), 0, 0.9, 0)
    assert p.place([a, b]) == 1
