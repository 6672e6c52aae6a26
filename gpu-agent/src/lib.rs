//! The agent that will sit beside each GPU: an HBM page pool and the movement of pages between an
//! engine's KV buffers and kvtier's tiers (device copies, shared memory, RDMA), encoding on the
//! way out and decoding on the way in. Nothing is implemented yet: engines reach the server through
//! `kvtier-client` over loopback until this crate lands (see DESIGN.md).
