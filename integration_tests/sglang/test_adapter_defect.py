"""SGLang 0.5.20's MambaRadixCache defect: a locked tombstone that loses its last child, then is released.

Upstream deletes a tombstone that becomes a leaf only while evicting its child, and skips it when it is locked; it
never looks at it again when the lock is released. The node stays as an unlocked tombstone leaf (breaking the
invariant that leaves hold a state), and the next full eviction that reaches it fails an assertion. Our tree
removes a stateless leaf the moment its last lock goes, so the same operations leave a valid tree and free pools.
"""

from __future__ import annotations

from contextlib import ExitStack

import pytest
from fixtures_sglang import CacheDriver, PoolSetup, make_ours, make_upstream, sglang_config

SHARED = list(range(1, 9))
FIRST = [*SHARED, *range(20, 32)]


@pytest.fixture
def config():
    with ExitStack() as stack:
        yield lambda **kwargs: stack.enter_context(sglang_config(**kwargs))


def _lock_a_tombstone_and_lose_its_last_child(driver: CacheDriver):
    """Returns the tombstone, locked, after its only child was evicted; and the lock's receipt."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    cache = driver.cache
    driver.run(FIRST, [1])  # one leaf holding FIRST and its state
    other = driver.new_request([*SHARED, 50, 51], [1])
    driver.match(other)  # splits the leaf after SHARED: the upper part is a tombstone with one child
    driver.reject(other)
    (tombstone,) = cache.root_node.children.values()
    assert len(tombstone.children) == 1
    receipt = cache.inc_lock_ref(tombstone)
    evicted = cache.evict(EvictParams(num_tokens=cache.full_evictable_size()))
    assert evicted.num_tokens_evicted == len(FIRST) - len(SHARED)  # the child went, the locked tombstone stayed
    assert not tombstone.children
    return tombstone, receipt


def test_upstream_fails_an_assertion(config):
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    config()
    driver = CacheDriver(PoolSetup(), make_upstream)
    cache = driver.cache
    tombstone, receipt = _lock_a_tombstone_and_lose_its_last_child(driver)
    cache.dec_lock_ref(tombstone, receipt.to_dec_params())
    assert tombstone in cache.root_node.children.values()  # an unlocked tombstone leaf stays in the tree
    assert cache.full_evictable_size() == len(SHARED)
    with pytest.raises(AssertionError, match="leaf node mamba value"):
        cache.evict(EvictParams(num_tokens=cache.full_evictable_size()))


def test_ours_stays_valid_and_returns_every_slot(config):
    config()
    driver = CacheDriver(PoolSetup(), make_ours)
    cache = driver.cache
    tombstone, receipt = _lock_a_tombstone_and_lose_its_last_child(driver)
    cache.sanity_check()
    cache.dec_lock_ref(tombstone, receipt.to_dec_params())
    assert not cache.root_node.children  # removed with its last lock, its KV back in the allocator
    assert cache.total_size() == (0, 0)
    cache.sanity_check()
    driver.drain()
    # And the cache keeps serving: the same requests again, then everything evicted.
    assert driver.run(FIRST, [1]) == 0
    assert driver.run([*FIRST, 2], [1]) == len(FIRST)
    driver.drain()
