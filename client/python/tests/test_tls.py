"""TLS from Python, against a real server whose certificates come from `kvtier cert`: a client
named by its certificate stores and loads its own KV over TLS on both planes; another tenant's
certificate gets `ForbiddenError`; a client that doesn't trust the node's CA, or speaks plain
TCP, gets an error (or a counted miss in never-raise mode), never bytes."""

import subprocess

import numpy as np
import pytest

import kvtier
from kvtier.server import find_binary
from servers import KvServer


def cert(*args):
    subprocess.run([find_binary(), "cert", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca, rogue = d / "ca", d / "rogue"
    cert("ca", "--dir", str(ca))
    cert("node", "--dir", str(ca), "--name", "node", "--host", "127.0.0.1")
    cert("client", "--dir", str(ca), "--name", "alice")
    cert("client", "--dir", str(ca), "--name", "bob")
    cert("ca", "--dir", str(rogue))
    return ca, rogue


@pytest.fixture(scope="module")
def tls_server(pki, tmp_path_factory):
    ca, _ = pki
    d = tmp_path_factory.mktemp("tls")
    cfg = d / "kvtier.toml"
    cfg.write_text(
        f'[tls]\ncert = "{ca / "node.pem"}"\nkey = "{ca / "node.key"}"\nclient_ca = "{ca / "ca.pem"}"\n\n'
        '[[tenants]]\nname = "alice"\ncert_names = ["alice"]\n\n'
        '[[tenants]]\nname = "bob"\ncert_names = ["bob"]\n'
    )
    srv = KvServer(d / "data", config=cfg).start()
    yield srv
    srv.stop()


def client(srv, ca, who=None, **kw):
    ident = {} if who is None else {"tls_cert": str(ca / f"{who}.pem"), "tls_key": str(ca / f"{who}.key")}
    return kvtier.Client(srv.addr, tls_ca=str(ca / "ca.pem"), **ident, **kw)


def test_a_certificate_is_a_tenant_over_tls(tls_server, pki):
    ca, rogue = pki
    alice = client(tls_server, ca, "alice", never_raise=False, samenode="off")
    ns = kvtier.Namespace("alice", "m@1", layers=2, kv_heads=2, head_dim=64, dtype="fp32", block_tokens=16)
    toks = list(range(500, 564))
    kv = np.random.default_rng(5).standard_normal(64 * ns.token_bytes // 4).astype(np.float32)
    assert alice.store(ns, toks, kv) == 4
    out = np.zeros_like(kv)
    assert alice.load_into(ns, toks, out) == 64
    np.testing.assert_array_equal(out, kv)

    bob = client(tls_server, ca, "bob", never_raise=False)
    with pytest.raises(kvtier.ForbiddenError):
        bob.load_into(ns, toks, np.zeros_like(kv))

    # Not trusted, not verified, not TLS: errors, and in never-raise mode counted misses.
    for bad in (
        kvtier.Client(tls_server.addr, never_raise=False, tls_ca=str(rogue / "ca.pem"),
                      tls_cert=str(ca / "alice.pem"), tls_key=str(ca / "alice.key"), timeout_s=5),
        client(tls_server, ca, None, never_raise=False, timeout_s=5),
        kvtier.Client(tls_server.addr, never_raise=False, timeout_s=5),
    ):
        with pytest.raises(kvtier.KvtierError):
            bad.lookup(ns, toks)
    quiet = kvtier.Client(tls_server.addr, timeout_s=5)
    assert quiet.load_into(ns, toks, np.zeros_like(kv)) == 0
    assert sum(quiet.misses.values()) >= 1

    # alice is still served, byte-exact.
    out[:] = 0
    assert alice.load_into(ns, toks, out) == 64
    np.testing.assert_array_equal(out, kv)


def test_bad_tls_arguments_are_value_errors(pki, tmp_path):
    ca, _ = pki
    with pytest.raises(ValueError, match="tls_key"):
        kvtier.Client("127.0.0.1:1", tls_ca=str(ca / "ca.pem"), tls_cert=str(ca / "alice.pem"))
    with pytest.raises(ValueError, match="tls_ca"):
        kvtier.Client("127.0.0.1:1", tls_cert=str(ca / "alice.pem"), tls_key=str(ca / "alice.key"))
    missing = tmp_path / "nope.pem"
    with pytest.raises(ValueError, match="nope.pem"):
        kvtier.Client("127.0.0.1:1", tls_ca=str(missing))
