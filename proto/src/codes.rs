//! Stable, namespaced error codes shown at the service boundary (in gRPC status messages as
//! `CODE: reason` and in the `kvtier-code` metadata entry), so clients and operators can act on
//! them without parsing prose.

pub const UNKNOWN_NAMESPACE: &str = "KV:Namespace:Unknown";
pub const INVALID_NAMESPACE: &str = "KV:Namespace:Invalid";
pub const KEY_LENGTH: &str = "KV:Key:Length";
pub const CAPACITY: &str = "KV:Capacity:Exhausted";
pub const CONTEXT_TOO_LONG: &str = "KV:Request:ContextTooLong";
pub const INVALID_REQUEST: &str = "KV:Request:Invalid";
pub const SESSION_NOT_FOUND: &str = "KV:Session:NotFound";
pub const SESSION_EXPIRED: &str = "KV:Session:Expired";
pub const SESSION_EXISTS: &str = "KV:Session:Exists";
pub const SESSION_VERSION: &str = "KV:Session:VersionConflict";
pub const UNAUTHENTICATED: &str = "KV:Auth:Unauthenticated";
/// Authenticated, but the principal may not touch that namespace (it belongs to another tenant).
pub const FORBIDDEN: &str = "KV:Auth:Forbidden";
/// The tenant is at one of its quotas (namespaces, sessions, session bytes).
pub const QUOTA: &str = "KV:Quota:Exceeded";
pub const DISK_FULL: &str = "KV:Disk:Full";
/// A listener refused the connection: its peer has `max_connections_per_peer` open already.
pub const TOO_MANY_CONNECTIONS: &str = "KV:Connections:TooMany";
/// Other members of the cluster could not be reached in time or answered wrongly (a park left
/// short of its copies, a peer down): the node itself is fine, and retrying later may succeed.
pub const UNAVAILABLE: &str = "KV:Cluster:Unavailable";
pub const INTERNAL: &str = "KV:Internal";

/// A block a data-plane `PUT` sent did not match its checksum (damaged on the way).
pub const BLOCK_CHECKSUM: &str = "KV:Block:Checksum";
/// A block's size, layout, header or codec does not fit its namespace.
pub const BLOCK_INVALID: &str = "KV:Block:Invalid";
/// A same-node item's offset and length fall outside its registered buffer.
pub const BLOCK_OUT_OF_RANGE: &str = "KV:Block:OutOfRange";
/// A one-sided read names a lease the connection does not hold (never granted, ended, expired).
pub const LEASE: &str = "KV:Lease:Invalid";
/// The block is held, but outside the memory a one-sided read reaches (disk, a peer, the agent's
/// HBM): load it with a `GET`.
pub const BLOCK_ELSEWHERE: &str = "KV:Block:Elsewhere";

/// The metadata key that carries the code beside the gRPC status.
pub const METADATA_KEY: &str = "kvtier-code";
