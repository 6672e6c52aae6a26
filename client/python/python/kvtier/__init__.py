"""kvtier: the Python client of the kvtier KV-cache tiering service.

    import kvtier
    client = kvtier.Client("127.0.0.1:7070")              # never raises: failures are misses
    ns = kvtier.Namespace("acme", "llama-3-8b@main", layers=32, kv_heads=8, head_dim=128,
                          dtype="bf16", block_tokens=16, salt=b"tenant-secret", codec="fp8")
    hit = client.lookup(ns, tokens)                        # tokens the server holds, from the start
    client.store(ns, tokens, kv)                           # kv: full blocks back to back (any buffer)
    n = client.load_into(ns, tokens, out)                  # decoded into `out`, returns tokens loaded
    buf = client.alloc_buffer(nbytes)                      # shared memory: NumPy/torch view it in place;
    out = np.frombuffer(buf, np.uint8)                     # calls whose KV lies in it go through the
    n = client.load_into(ns, tokens, out)                  # server's same-node socket when on this host

`Client(addr, never_raise=False)` raises a `KvtierError` subclass instead. KV goes in and out as
any C-contiguous buffer; `as_bytes` turns NumPy arrays and torch tensors into one without a copy.
Engine adapters: `kvtier.transformers` (Hugging Face transformers' `DynamicCache`).
"""

from ._native import (
    BlockMissingError,
    CapacityError,
    Client,
    ForbiddenError,
    InvalidRequestError,
    KvtierError,
    Namespace,
    QuotaExceededError,
    SessionNotFoundError,
    SharedBuffer,
    UnauthenticatedError,
    UnavailableError,
    VersionConflictError,
)

__all__ = [
    "BlockMissingError",
    "CapacityError",
    "Client",
    "ForbiddenError",
    "InvalidRequestError",
    "KvtierError",
    "Namespace",
    "QuotaExceededError",
    "SessionNotFoundError",
    "SharedBuffer",
    "UnauthenticatedError",
    "UnavailableError",
    "VersionConflictError",
    "as_bytes",
    "resident_bytes",
]


def resident_bytes(client, ns):
    """Payload bytes the server holds, over every tier (from `client.stats`)."""
    return sum(t["resident_bytes"] for t in client.stats(ns).get("tiers", {}).values())


def as_bytes(obj):
    """A writable-if-possible flat byte view of a C-contiguous array, without copying.

    Accepts anything with the buffer protocol (NumPy arrays, bytearray, memoryview) and CPU torch
    tensors of any dtype (bf16 included, which NumPy cannot represent)."""
    mod = type(obj).__module__
    if mod.startswith("torch"):
        if obj.device.type != "cpu":
            raise ValueError(f"tensor is on {obj.device}; move it to the CPU first")
        if not obj.is_contiguous():
            raise ValueError("tensor is not contiguous; call .contiguous() first")
        import torch

        obj = obj.view(torch.uint8).numpy() if obj.dim() > 0 else obj.reshape(1).view(torch.uint8).numpy()
    view = memoryview(obj)
    if not view.c_contiguous:
        raise ValueError("buffer is not C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view
