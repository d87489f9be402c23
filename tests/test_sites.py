import threading

import pytest

import tripwire
from tripwire import SiteRegistry


def test_register_returns_stable_rows(registry):
    a = registry.register("a", description="first")
    b = registry.register("b", fatal=True)
    assert (a.id, b.id) == (0, 1)
    assert registry.register("a", description="first") is a
    assert registry.get("b") is b and registry.by_id(1) is b and registry.resolve("a") is a


def test_same_name_different_attributes_raises(registry):
    registry.register("a", description="x")
    with pytest.raises(ValueError, match="already registered"):
        registry.register("a", description="y")
    with pytest.raises(ValueError, match="already registered"):
        registry.register("a", description="x", fatal=True)


@pytest.mark.parametrize("name", ["", "   ", None, 3])
def test_bad_names(registry, name):
    with pytest.raises((ValueError, TypeError)):
        registry.register(name)


def test_capacity_is_enforced():
    reg = SiteRegistry(capacity=2)
    reg.register("a")
    reg.register("b")
    with pytest.raises(ValueError, match="capacity of 2 rows"):
        reg.register("c")


def test_site_from_another_registry_refused(registry):
    other = SiteRegistry(capacity=4)
    s = other.register("x")
    registry.register("x")
    with pytest.raises(ValueError, match="another registry"):
        registry.resolve(s)
    with pytest.raises(KeyError):
        registry.resolve(99)
    with pytest.raises(KeyError):
        registry.resolve("nope")
    with pytest.raises(TypeError):
        registry.resolve(1.5)


def test_thread_safe_registration():
    reg = SiteRegistry(capacity=1024)
    results = []

    def work(k):
        for i in range(100):
            results.append(reg.register(f"s{i}", description="d"))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(reg) == 100
    assert sorted({s.id for s in results}) == list(range(100))
    for s in results:
        assert reg.by_id(s.id) is s


def test_default_registry_functions():
    s = tripwire.register_site("test_sites.default", description="d")
    assert s in tripwire.sites()
    assert tripwire.register_site("test_sites.default", description="d") is s
