"""Redis key names of the registry: the one place they are spelled.

Key layout (`<m>` is the model id with `{`, `}`, `%`, blanks and non-ASCII percent-encoded;
`<hex>` is a prefix key as 16 lowercase hex digits; `<bid>` a backend id):

    kvr:{m:<m>}:k:<hex>      SET   members "<bid>|<instance_id>" that hold the key;
                                   EXPIRE key_ttl, refreshed on every (re)advertise
    kvr:{m:<m>}:p:<hex>      ZSET  routing marks: <bid> -> expiry (server ms)
    kvr:{m:<m>}:rec:<bid>    STR   the backend record (JSON), PX record_ttl: a copy of
                                   kvr:b:<bid> kept under the model's hash tag so the
                                   lookup script never leaves the model's slot
    kvr:{m:<m>}:backends     ZSET  <bid> -> last heartbeat (unix s) of backends serving
                                   the model; entries older than key_ttl are pruned
    kvr:{m:<m>}:idx:<bid>    SET   <hex> keys this backend id advertised and has not
                                   withdrawn, for purges and resyncs; EXPIRE key_ttl
    kvr:{m:<m>}:d:<hex>      SET   members holding the key on their disk tier, as k:
    kvr:{m:<m>}:didx:<bid>   SET   the disk tier's idx:
    kvr:b:<bid>              STR   the backend record (JSON), PX record_ttl
    kvr:backends             ZSET  <bid> -> last heartbeat, for live_backends()
    kvr:resp:<tag>:<id>      STR   a stored /v1/responses answer (its conversation,
                                   encrypted by the proxy), PX its TTL; <tag> is a
                                   keyed hash of the API key's scope, <id> resp_<hex>
    kvr:{models}:states     HASH  "<model>|<machine>" -> that machine's state of a
                                   configured model (JSON, kvroute/core/model_loads.py)
    kvr:{models}:used       HASH  <model> -> last request (unix s), from proxies
    kvr:{models}:load       STREAM {model, origin} load requests, read by every
                                   `kvroute serve`; MAXLEN ~1000, EXPIRE 60 s
    kvr:{lim:<s>}:rpm:<minute>  STR  requests a usage-limit subject began in that minute
                                   (unix s // 60, server time); EXPIRE 120 s
    kvr:{lim:<s>}:tpm:<minute>  STR  tokens (prompt + generated) it used that minute
    kvr:{lim:<s>}:tpd:<day>     STR  tokens it used that UTC day (unix s // 86400); EXPIRE 2 days
    kvr:{lim:<s>}:open          ZSET its requests in flight: id -> lease expiry (server ms)

`<s>` is a usage-limit subject (kvroute/proxy/limits.py): `scope:<scope>`, or `key:<hash>`
for a rule naming one API key (a hash, never the key), encoded as `<m>` is.

Everything a model's lookup touches shares the hash tag `{m:<m>}`, so one model
lives in one Redis Cluster slot; everything one limit subject counts shares `{lim:<s>}`. The scripts declare the model's `backends` key
(so a cluster client routes them to the right slot) and derive the other key names
from a prefix inside the script: they are undeclared but always in that same slot.
"""

from __future__ import annotations

import re
import struct
from urllib.parse import quote


_TAG_SAFE = "!#$&'()*+,-./:;<=>?@[]^_`|~"


def model_tag(model: str) -> str:
    if not isinstance(model, str) or not model:
        raise ValueError("model must be a non-empty string")
    # Braces would break the hash tag; '%' is escaped so the encoding is injective.
    return "kvr:{m:" + quote(model, safe=_TAG_SAFE) + "}:"


def limit_tag(subject: str) -> str:
    """The key prefix of one usage-limit subject: its counters share one hash tag."""
    if not isinstance(subject, str) or not subject:
        raise ValueError("subject must be a non-empty string")
    return "kvr:{lim:" + quote(subject, safe=_TAG_SAFE) + "}:"


LIMIT_OPEN = "open"  # the subject's requests in flight (the key its scripts declare)


# Ids appear in key names and set members ("<bid>|<iid>"), and the lookup script finds
# the instance id in the record JSON by pattern: keep them to a plain alphabet.
_ID_RE = re.compile(r"[A-Za-z0-9._:@/+-]{1,200}")


def check_id(name: str, value: str) -> None:
    if not isinstance(value, str) or not _ID_RE.fullmatch(value):
        raise ValueError(f"{name} must be 1-200 characters of [A-Za-z0-9._:@/+-], got {value!r}")


def record_key(backend_id: str) -> str:
    return f"kvr:b:{backend_id}"


def tier_marker_key(backend_id: str, tier: str) -> str:
    """The instance id whose `tier` keys Redis holds; expires with the record."""
    return f"kvr:b:{backend_id}:{tier}"


ALL_BACKENDS = "kvr:backends"

RESPONSE_ID_RE = re.compile(r"resp_[0-9a-f]{32}")  # the proxy's own ids (new_id("resp_"))
_SCOPE_TAG_RE = re.compile(r"[0-9a-f]{32}")


def response_key(scope_tag: str, response_id: str) -> str:
    # Both parts come from the proxy's own hashing and ids: checked so no client text
    # ever becomes (part of) a key name.
    if not _SCOPE_TAG_RE.fullmatch(scope_tag) or not RESPONSE_ID_RE.fullmatch(response_id):
        raise ValueError("malformed response key")
    return f"kvr:resp:{scope_tag}:{response_id}"


def chain_hex(keys: list[int]) -> str:
    """The chain as one string of 16-hex-digit keys: one argument, split in Lua."""
    try:
        return struct.pack(f">{len(keys)}Q", *keys).hex()
    except struct.error as e:
        raise ValueError(f"prefix keys must be unsigned 64-bit ints: {e}") from None


def member(backend_id: str, instance_id: str) -> str:
    return f"{backend_id}|{instance_id}"


# Models loaded on demand (kvroute/core/model_loads.py). Not under a model's hash tag:
# one hash holds every model, so a proxy reads all states in one round trip. The
# three share the tag {models}, so the one command that names two of them (the last
# machine's clean-up) stays in one slot of a Redis Cluster.
MODEL_STATES = "kvr:{models}:states"
MODELS_USED = "kvr:{models}:used"
MODEL_LOADS = "kvr:{models}:load"


def tier_keys(tier: str) -> tuple[str, str]:
    """The key-set kind and the index suffix of a tier: what a backend holds in RAM
    (k:, idx:) and on its disk tier (d:, didx:) is advertised apart, so the proxy
    can weigh a restore against a RAM hit."""
    if tier == "ram":
        return "k:", "idx:"
    if tier == "disk":
        return "d:", "didx:"
    raise ValueError(f"unknown tier {tier!r}")
