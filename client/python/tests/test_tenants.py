"""Tenants from Python, against a real server configured with two tenants: a tenant's namespace
is another tenant's `ForbiddenError` (or a counted miss in never-raise mode), never its bytes; a
quota is a `QuotaExceededError`; the owner unregisters its namespace."""

import numpy as np
import pytest

import kvtier
from servers import KvServer

TOKEN_A = "python-tenant-a-0001"
TOKEN_B = "python-tenant-b-0002"


@pytest.fixture(scope="module")
def tenant_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("tenants")
    cfg = d / "kvtier.toml"
    cfg.write_text(
        f'[[tenants]]\nname = "a"\ntokens = ["{TOKEN_A}"]\nmax_namespaces = 2\n\n'
        f'[[tenants]]\nname = "b"\ntokens = ["{TOKEN_B}"]\n'
    )
    srv = KvServer(d / "data", config=cfg).start()
    yield srv
    srv.stop()


def ns(tenant, salt=b""):
    return kvtier.Namespace(tenant, "m@1", layers=2, kv_heads=2, head_dim=64, dtype="fp32", block_tokens=16, salt=salt)


def test_another_tenant_gets_forbidden_never_bytes(tenant_server):
    a = kvtier.Client(tenant_server.addr, never_raise=False, auth_token=TOKEN_A)
    b = kvtier.Client(tenant_server.addr, never_raise=False, auth_token=TOKEN_B)
    mine = ns("a", b"secret")
    toks = list(range(100, 148))
    kv = np.random.default_rng(1).standard_normal(48 * mine.token_bytes // 4).astype(np.float32)
    assert a.store(mine, toks, kv) == 3
    # b knows a's namespace spec, salt included: the worst case.
    out = np.zeros_like(kv)
    with pytest.raises(kvtier.ForbiddenError):
        b.load_into(mine, toks, out)
    with pytest.raises(kvtier.ForbiddenError):
        b.lookup(mine, toks)
    with pytest.raises(kvtier.ForbiddenError):
        b.store(mine, toks, np.zeros_like(kv))
    assert not out.any(), "no byte of a's reached b"
    # Never-raise mode: a miss, counted under its reason.
    quiet = kvtier.Client(tenant_server.addr, auth_token=TOKEN_B)
    assert quiet.load_into(mine, toks, out) == 0
    assert quiet.misses.get("forbidden", 0) >= 1
    # a's bytes are untouched.
    assert a.load_into(mine, toks, out) == 48
    np.testing.assert_array_equal(out, kv)
    # A namespace in another tenant's name can't even be registered... (b, as "a")
    with pytest.raises(kvtier.ForbiddenError):
        b.lookup(ns("a", b"other"), toks)


def test_quota_and_unregister(tenant_server):
    a = kvtier.Client(tenant_server.addr, never_raise=False, auth_token=TOKEN_A)
    b = kvtier.Client(tenant_server.addr, never_raise=False, auth_token=TOKEN_B)
    toks = list(range(16))
    kv = np.ones(16 * ns("a").token_bytes // 4, dtype=np.float32)
    first = ns("a", b"q1")
    assert a.store(first, toks, kv) == 1
    # The first test's namespace and this one: a's max_namespaces of 2 is reached.
    with pytest.raises(kvtier.QuotaExceededError):
        a.store(ns("a", b"q2"), toks, kv)
    with pytest.raises(kvtier.ForbiddenError):
        b.unregister(first)
    assert a.unregister(first) == (0, 1)
    # Its slot is free again.
    assert a.store(ns("a", b"q2"), toks, kv) == 1


def test_a_refused_credential_is_its_own_error_and_stays_so(tenant_server):
    # It was an UnavailableError ("could not be reached") reading "unauthenticated: unauthenticated:
    # KV:Auth:...", and for the next second "recently failed; backing off", which hid the cause.
    for token in (None, "not-a-token-of-this-node"):
        c = kvtier.Client(tenant_server.addr, never_raise=False, auth_token=token)
        for _ in range(2):
            with pytest.raises(kvtier.UnauthenticatedError, match="^KV:Auth:Unauthenticated"):
                c.lookup(ns("a"), list(range(16)))
        quiet = kvtier.Client(tenant_server.addr, auth_token=token)
        assert quiet.lookup(ns("a"), list(range(16))) == 0
        assert quiet.last_miss[0] == "unauthenticated"
