"""The backend pool at run time: what its followers (index, metrics, KV event subscribers) see."""

from __future__ import annotations

from router.config import BackendConfig
from router.fleet.backends import BackendPool


def follow(pool: BackendPool) -> list[tuple[str, str]]:
    seen: list[tuple[str, str]] = []
    pool.subscribe(lambda b: seen.append(("added", b.url)), lambda b: seen.append(("removed", b.url)))
    return seen


def test_followers_see_additions_replacements_and_removals():
    pool = BackendPool([BackendConfig("static", "http://127.0.0.1:1")])
    seen = follow(pool)
    assert seen == []  # backends already there are the follower's to iterate

    first = pool.add(BackendConfig("pod-a", "http://127.0.0.2:8000"))
    assert pool.add(BackendConfig("pod-a", "http://127.0.0.2:8000")) is first
    # Same name, new address (a restarted pod): a new backend, with nothing believed of the old.
    second = pool.add(BackendConfig("pod-a", "http://127.0.0.9:8000"))
    assert second is not first
    assert pool.remove("pod-a") is second
    assert pool.remove("pod-a") is None
    assert seen == [
        ("added", "http://127.0.0.2:8000"),
        ("removed", "http://127.0.0.2:8000"),
        ("added", "http://127.0.0.9:8000"),
        ("removed", "http://127.0.0.9:8000"),
    ]
    assert [b.name for b in pool] == ["static"]
