//! The catalog of every Prometheus metric kvtier records: its name, type, labels, which process
//! records it, and the one-line help an operator reads as its `# HELP` on `/metrics`.
//!
//! The metrics are recorded where things happen (`counter!("kvtier_…")` across the node, the
//! `kvtier agent` command and the client library); this table only describes them. A unit test
//! scans the workspace's sources and fails when a metric is recorded that is not here, is here
//! under another type, labels or process, or is here but no longer recorded anywhere.
//!
//! [`describe_all`] hands every help text to the installed recorder ([`crate::metrics::install`]
//! calls it). The exporter prints a family only once it has a value, so [`register_zeros`] puts
//! the label-less counters a process records in at 0 from its start (the node does so when it
//! opens its state): a scrape then shows them, with their help, before their first event. A
//! counter recorded only with labels gets no unlabelled series, and gauges are left alone (each
//! is set where its value is known).

/// What a metric is, as Prometheus types it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetricKind {
    Counter,
    Gauge,
    Histogram,
}

/// The code that records a metric, and so the processes where it can appear.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordedBy {
    /// The node (`kvtier serve`): this crate, and the peer transport the `kvtier` binary gives it.
    Node,
    /// The GPU agent (`kvtier agent`).
    Agent,
    /// The client library (`kvtier-client`), in whatever process uses it: the node (its calls to
    /// peers), the agent, an engine.
    Client,
}

/// One metric: its name, type, label keys, recorder and help text.
#[derive(Clone, Copy, Debug)]
pub struct MetricDoc {
    pub name: &'static str,
    pub kind: MetricKind,
    /// The label keys of every series (none: one series without labels).
    pub labels: &'static [&'static str],
    pub by: RecordedBy,
    pub help: &'static str,
}

const fn counter(name: &'static str, labels: &'static [&'static str], by: RecordedBy, help: &'static str) -> MetricDoc {
    MetricDoc { name, kind: MetricKind::Counter, labels, by, help }
}

const fn gauge(name: &'static str, labels: &'static [&'static str], by: RecordedBy, help: &'static str) -> MetricDoc {
    MetricDoc { name, kind: MetricKind::Gauge, labels, by, help }
}

const fn histogram(
    name: &'static str,
    labels: &'static [&'static str],
    by: RecordedBy,
    help: &'static str,
) -> MetricDoc {
    MetricDoc { name, kind: MetricKind::Histogram, labels, by, help }
}

use RecordedBy::{Agent, Client, Node};

/// Every metric kvtier records, one entry per name.
pub const METRICS: &[MetricDoc] = &[
    // Requests and errors.
    counter(
        "kvtier_requests_total",
        &["op"],
        Node,
        "Requests served, by `op`: a gRPC method (e.g. park) or a data-plane operation (e.g. dataplane_get).",
    ),
    histogram(
        "kvtier_request_seconds",
        &["op"],
        Node,
        "Time to answer a request in seconds, by `op` as in kvtier_requests_total.",
    ),
    counter(
        "kvtier_request_errors_total",
        &["op", "code"],
        Node,
        "gRPC calls answered with a status other than OK, by `op` and `code` (the gRPC status, e.g. cancelled).",
    ),
    counter(
        "kvtier_errors_total",
        &["kind"],
        Node,
        "Errors by `kind` (e.g. io, disk_full, capacity, missing_blocks, unauthenticated, tls_handshake).",
    ),
    counter(
        "kvtier_requests_polled_total",
        &["plane"],
        Node,
        "Requests that arrived while their connection polled for them, by `plane` (dataplane, samenode).",
    ),
    // Connections.
    gauge(
        "kvtier_connections_open",
        &["listener"],
        Node,
        "Connections open now, by `listener` (grpc, data plane, same-node, quic).",
    ),
    counter(
        "kvtier_connections_refused_total",
        &["listener", "reason"],
        Node,
        "Connections closed on arrival, by `listener` and `reason` (per_peer or per_tenant: the limit met).",
    ),
    counter("kvtier_quic_connections_total", &[], Node, "QUIC connections that completed their handshake."),
    counter("kvtier_quic_streams_total", &[], Node, "QUIC streams accepted, each served as a data-plane connection."),
    counter(
        "kvtier_dataplane_congestion_total",
        &["cc"],
        Node,
        "Same-host data-plane connections given a congestion control, by `cc` (the algorithm, or refused).",
    ),
    counter(
        "kvtier_dataplane_congestion_switches_total",
        &["cc"],
        Node,
        "Per-request congestion-control switches on same-host data-plane connections, by `cc` (switched to).",
    ),
    counter(
        "kvtier_dataplane_pin_leases_expired_total",
        &[],
        Node,
        "Pins a data-plane connection held for an upload, released after idle_timeout without a new one.",
    ),
    // Credentials, grants and quotas.
    counter(
        "kvtier_auth_failed_total",
        &[],
        Node,
        "Credentials refused: an unknown token, or a token naming another principal than the client certificate.",
    ),
    counter(
        "kvtier_auth_denied_total",
        &["access"],
        Node,
        "Requests refused because their principal may not use the namespace, by `access` (read, write).",
    ),
    counter(
        "kvtier_namespace_not_registered_total",
        &[],
        Node,
        "Registrations by a grantee of another tenant's namespace the owner has not registered (Forbidden).",
    ),
    counter(
        "kvtier_quota_refusals_total",
        &["tenant", "quota"],
        Node,
        "Requests refused for a tenant's quota, by `tenant` and `quota` (e.g. max_sessions, max_namespaces).",
    ),
    counter(
        "kvtier_samenode_tickets_total",
        &["event"],
        Node,
        "Same-node socket tickets, by `event` (issued, redeemed, expired, unknown).",
    ),
    counter(
        "kvtier_peer_credential_refused_total",
        &[],
        Node,
        "Peer calls another node refused for this node's credential (every node of a cluster must share auth_token).",
    ),
    // Tiers.
    counter(
        "kvtier_tier_hits_total",
        &["tier"],
        Node,
        "Block reads a tier answered with the block, by `tier` (dram, in_transit, disk, redis, peer).",
    ),
    counter(
        "kvtier_tier_misses_total",
        &["tier"],
        Node,
        "Block reads a tier did not hold the block for, by `tier` (dram, disk, redis, peer).",
    ),
    counter(
        "kvtier_tier_bytes_in_total",
        &["tier"],
        Node,
        "Payload bytes into a tier, by `tier`: written to dram or disk, or received from redis or peers.",
    ),
    counter(
        "kvtier_tier_bytes_out_total",
        &["tier"],
        Node,
        "Payload bytes out of a tier, by `tier`: served from dram or disk, or sent to redis or peers.",
    ),
    counter("kvtier_tier_evictions_total", &["tier"], Node, "Blocks evicted, by `tier` (dram, disk)."),
    counter(
        "kvtier_tier_busy_total",
        &["tier"],
        Node,
        "Block reads turned away because the tier was busy (its I/O pool or read budget full), by `tier` (disk).",
    ),
    gauge("kvtier_tier_resident_bytes", &["tier"], Node, "Payload bytes held now, by `tier` (dram, disk)."),
    gauge(
        "kvtier_tier_allocated_bytes",
        &["tier"],
        Node,
        "Bytes allocated now, by `tier`: DRAM slab bytes, or disk segment file bytes (live and dead records).",
    ),
    gauge(
        "kvtier_tier_capacity_bytes",
        &["tier"],
        Node,
        "Configured capacity in bytes, by `tier` (dram, disk; redis: the node's Redis budget).",
    ),
    gauge("kvtier_tier_blocks", &["tier"], Node, "Blocks held now, by `tier` (dram, disk)."),
    gauge(
        "kvtier_tier_pinned_bytes",
        &["tier"],
        Node,
        "Payload bytes of pinned blocks (parked sessions, pin leases) now, by `tier` (dram, disk).",
    ),
    // The DRAM tier.
    gauge(
        "kvtier_dram_leases",
        &[],
        Node,
        "DRAM slot leases outstanding now (slots reserved for writes not yet committed).",
    ),
    gauge("kvtier_dram_leased_bytes", &[], Node, "Bytes of DRAM slots reserved under outstanding leases now."),
    counter(
        "kvtier_dram_leases_expired_total",
        &[],
        Node,
        "DRAM slot leases revoked because they were not committed within lease_timeout.",
    ),
    counter(
        "kvtier_dram_leases_unpinned_total",
        &[],
        Node,
        "Pin leases taken without a DRAM pin past max_pinned_ratio (the disk tier keeps the block instead).",
    ),
    gauge("kvtier_dram_prefaulted_bytes", &[], Node, "Bytes of the DRAM arena prefaulted so far."),
    counter(
        "kvtier_quota_evictions_total",
        &[],
        Node,
        "DRAM blocks evicted to keep a tenant's dram_bytes quota, or the tenants' shared pool, within bounds.",
    ),
    // The disk tier and demotion.
    histogram("kvtier_disk_read_seconds", &[], Node, "Time to read one block from a disk segment, in seconds."),
    histogram(
        "kvtier_disk_write_seconds",
        &[],
        Node,
        "Time to write one block to a disk segment, in seconds (a second try after a full file system included).",
    ),
    gauge(
        "kvtier_disk_queue_depth",
        &[],
        Node,
        "Blocks evicted from DRAM waiting in the demotion queue to go to disk.",
    ),
    counter(
        "kvtier_disk_demotions_total",
        &[],
        Node,
        "DRAM evictions the demotion thread handled without error (written, already on disk, or corrupt).",
    ),
    counter(
        "kvtier_disk_demotions_failed_total",
        &[],
        Node,
        "Blocks evicted from DRAM whose write to disk failed (not kept).",
    ),
    counter(
        "kvtier_disk_demotions_dropped_total",
        &[],
        Node,
        "Blocks evicted from DRAM not demoted because the demotion queue was full.",
    ),
    counter(
        "kvtier_disk_demotions_over_quota_total",
        &[],
        Node,
        "Blocks evicted from DRAM not demoted because their tenant's disk quota was full.",
    ),
    counter(
        "kvtier_disk_demotions_corrupt_total",
        &[],
        Node,
        "Blocks evicted from DRAM not demoted because they failed their checksum.",
    ),
    counter("kvtier_disk_recoded_total", &[], Node, "Demoted blocks re-encoded with disk_codec before being written."),
    counter(
        "kvtier_disk_recode_saved_bytes_total",
        &[],
        Node,
        "Payload bytes saved by re-encoding demoted blocks with disk_codec.",
    ),
    counter(
        "kvtier_disk_recode_skipped_busy_total",
        &[],
        Node,
        "Demoted blocks written as they came, not re-encoded, because the demotion queue was backed up.",
    ),
    counter(
        "kvtier_disk_recode_refused_total",
        &[],
        Node,
        "Demoted blocks disk_codec refused to encode, written as they came.",
    ),
    counter("kvtier_disk_promotions_total", &[], Node, "Disk blocks copied back into DRAM on their second read."),
    counter(
        "kvtier_disk_compactions_total",
        &[],
        Node,
        "Disk segments compacted to make room where every other segment held pinned blocks: their pinned blocks \
         moved to a new segment, the rest evicted (counted in kvtier_tier_evictions_total), the file removed.",
    ),
    counter(
        "kvtier_disk_full_evictions_total",
        &[],
        Node,
        "Disk segments evicted to make room because the file system filled before the tier reached its capacity.",
    ),
    counter(
        "kvtier_disk_discarded_blocks_total",
        &[],
        Node,
        "Damaged or torn records skipped by the scan of the disk segments at start.",
    ),
    counter(
        "kvtier_disk_recovered_blocks_total",
        &[],
        Node,
        "Blocks recovered from the disk segments at start (those of deleted namespaces not counted).",
    ),
    counter(
        "kvtier_disk_refused_hidden_frames_total",
        &[],
        Node,
        "Blocks not written to disk because their payload holds what a recovery scan would take for a record header.",
    ),
    // Namespaces.
    gauge("kvtier_namespaces", &[], Node, "Namespaces registered on this node now."),
    counter("kvtier_namespace_log_compactions_total", &[], Node, "Compactions of the namespace log (namespaces.log)."),
    counter(
        "kvtier_namespace_log_compactions_failed_total",
        &[],
        Node,
        "Compactions of the namespace log that failed (the log appended to as it was).",
    ),
    counter(
        "kvtier_namespace_log_marks_pruned_total",
        &[],
        Node,
        "Namespace-log unregister and purge marks dropped at start, no disk segment they cover being left.",
    ),
    // Sessions.
    gauge("kvtier_sessions", &[], Node, "Parked sessions held on this node now."),
    counter("kvtier_sessions_expired_total", &[], Node, "Parked sessions that expired (their TTL ran out)."),
    counter("kvtier_sessions_recovered_total", &[], Node, "Sessions restored from the session log at start."),
    counter(
        "kvtier_sessions_lost_total",
        &[],
        Node,
        "Sessions in the session log not restored at start because their blocks were gone.",
    ),
    counter("kvtier_session_log_compactions_total", &[], Node, "Compactions of the session log."),
    counter(
        "kvtier_session_log_compactions_failed_total",
        &[],
        Node,
        "Compactions of the session log that failed (the log appended to as it was).",
    ),
    counter(
        "kvtier_session_create_checks_refused_total",
        &[],
        Node,
        "Session creates refused because their tenant had its most cluster checks in flight (retry).",
    ),
    counter(
        "kvtier_session_create_claims_waited_total",
        &[],
        Node,
        "Session creates that waited for another node's cluster claim on the same session before taking it.",
    ),
    counter(
        "kvtier_session_create_claims_failed_total",
        &[],
        Node,
        "Session creates that went on without a cluster claim because taking one failed.",
    ),
    counter(
        "kvtier_session_created_unverified_total",
        &[],
        Node,
        "Sessions created without an answer from every member (older copies elsewhere are then superseded).",
    ),
    counter("kvtier_session_adopted_total", &[], Node, "Newer copies of a session adopted from another node."),
    counter(
        "kvtier_session_adopt_failures_total",
        &[],
        Node,
        "Resumes that found a newer copy of the session on another node and could not adopt it.",
    ),
    counter("kvtier_session_copies_total", &[], Node, "Copies of parked sessions made on other owners at the park."),
    counter(
        "kvtier_session_underreplicated_total",
        &[],
        Node,
        "Parks that left fewer copies than cluster_rf (made up for by re-replication).",
    ),
    counter(
        "kvtier_session_recopied_total",
        &[],
        Node,
        "Session copies made again, by re-replication, on an owner that lacked one.",
    ),
    counter(
        "kvtier_session_copies_refused_total",
        &[],
        Node,
        "Session copies an owner refused for want of room or for a tenant's quota.",
    ),
    counter(
        "kvtier_session_concurrent_writes_total",
        &[],
        Node,
        "Session copies an owner refused because a concurrent write had left another version there.",
    ),
    counter(
        "kvtier_session_conflicting_copies_total",
        &[],
        Node,
        "Copies of a session found on another member at the same version but with another context.",
    ),
    counter(
        "kvtier_session_stale_copies_dropped_total",
        &[],
        Node,
        "Session copies dropped here because the session was dropped elsewhere while this node was away.",
    ),
    counter(
        "kvtier_session_dropped_copies_refused_total",
        &[],
        Node,
        "Session copies from another node refused here because the session was dropped or superseded.",
    ),
    counter(
        "kvtier_session_superseded_copies_dropped_total",
        &[],
        Node,
        "Older copies of a created session dropped on other members.",
    ),
    counter(
        "kvtier_session_supersede_skipped_total",
        &[],
        Node,
        "Drops of older session copies on other members not started because the most were running already.",
    ),
    // KV events.
    gauge("kvtier_event_watchers", &[], Node, "KV event watchers (WatchEvents streams) open now."),
    counter(
        "kvtier_event_watchers_refused_total",
        &["limit"],
        Node,
        "WatchEvents streams refused, by `limit` (node: events_max_watchers; tenant: its per-tenant limit).",
    ),
    counter("kvtier_event_watchers_lagged_total", &[], Node, "Times a watcher fell behind and missed KV events."),
    counter("kvtier_events_published_total", &[], Node, "KV events published to watchers."),
    // The G1 agent tier, as the node sees it.
    counter(
        "kvtier_agent_demands_total",
        &[],
        Node,
        "Reads of blocks only G1 holds that the node asked a GPU agent to spill into DRAM.",
    ),
    counter(
        "kvtier_agent_demand_hits_total",
        &[],
        Node,
        "Blocks demanded of a GPU agent that landed in DRAM for their readers.",
    ),
    counter(
        "kvtier_agent_demand_misses_total",
        &["reason"],
        Node,
        "Reads of blocks only G1 holds that missed, by `reason` (timeout, unspilled, not_queued, waiters_full).",
    ),
    gauge(
        "kvtier_agent_index_keys",
        &[],
        Node,
        "Keys GPU agents reported holding in G1, as this node indexes them now.",
    ),
    gauge(
        "kvtier_agent_links",
        &[],
        Node,
        "GPU agents' demand streams open now, counted once per agent and namespace.",
    ),
    counter(
        "kvtier_agent_index_full_total",
        &[],
        Node,
        "Keys agents reported stored that were not indexed because the namespace had agent_index_max_keys.",
    ),
    // Remote (one-sided) leases on the DRAM arena.
    gauge("kvtier_remote_read_leased_bytes", &[], Node, "Bytes of DRAM blocks held under remote read leases now."),
    gauge("kvtier_remote_write_leased_bytes", &[], Node, "Bytes of DRAM slots held under remote write leases now."),
    counter(
        "kvtier_remote_leases_abandoned_total",
        &[],
        Node,
        "Remote write leases left uncommitted when their connection ended (their slots quarantined before reuse).",
    ),
    // The same-node socket.
    gauge(
        "kvtier_samenode_registered_bytes",
        &[],
        Node,
        "Bytes of client buffers registered on the same-node socket now.",
    ),
    // Cluster membership.
    gauge("kvtier_membership_members", &[], Node, "Cluster members this node sees now, itself included."),
    gauge(
        "kvtier_membership_stale",
        &[],
        Node,
        "1 while this node cannot reach the membership's Redis (its view of the members may be stale), else 0.",
    ),
    gauge(
        "kvtier_membership_mismatched_members",
        &[],
        Node,
        "Members whose shared settings (cluster_rf, auth, tenants) differ from this node's.",
    ),
    counter("kvtier_membership_errors_total", &[], Node, "Membership ticks that failed to reach Redis."),
    counter(
        "kvtier_membership_invalid_total",
        &[],
        Node,
        "Member entries read from Redis that could not be used (undecodable, or past the most members).",
    ),
    counter(
        "kvtier_membership_superseded_total",
        &[],
        Node,
        "Times this node was fenced because another live process answers for its member id.",
    ),
    counter(
        "kvtier_cluster_claims_lost_total",
        &[],
        Node,
        "Cluster claims that ran out while held (their renewals went unanswered).",
    ),
    // The peer tier.
    counter("kvtier_peer_requests_total", &[], Node, "Calls made to other nodes of the cluster."),
    counter(
        "kvtier_peer_errors_total",
        &["op"],
        Node,
        "Failed calls to peers, by `op` (get, put, exists, delete, route, session; bad_block: failed checks).",
    ),
    counter(
        "kvtier_peer_hedged_keys_total",
        &[],
        Node,
        "Keys asked of another owner too because the first was slow to answer (hedged).",
    ),
    counter("kvtier_peer_hedge_wins_total", &[], Node, "Blocks a hedged request brought instead of the first owner."),
    counter(
        "kvtier_peer_moved_on_keys_total",
        &[],
        Node,
        "Keys an owner new to them missed that were asked of the next candidate.",
    ),
    counter(
        "kvtier_peer_read_repairs_total",
        &[],
        Node,
        "Blocks queued to be copied to owners a read found without them (read repair).",
    ),
    counter(
        "kvtier_peer_read_repairs_dropped_total",
        &[],
        Node,
        "Read-repair blocks not copied to their owner (no room in the forward queue, or the copy failed).",
    ),
    gauge(
        "kvtier_peer_forward_queue_bytes",
        &[],
        Node,
        "Payload bytes of stored blocks waiting to be forwarded to their other owners.",
    ),
    counter(
        "kvtier_peer_forwarded_blocks_total",
        &[],
        Node,
        "Blocks other owners took from this node (forwards and handoffs).",
    ),
    counter(
        "kvtier_peer_forward_dropped_total",
        &[],
        Node,
        "Stored blocks not forwarded to their other owners (held only here).",
    ),
    counter(
        "kvtier_peer_repaired_here_total",
        &[],
        Node,
        "Blocks loaded from a peer and kept in DRAM because this node is one of their owners.",
    ),
    counter(
        "kvtier_peer_cached_total",
        &[],
        Node,
        "Blocks loaded from a peer and cached in DRAM at low priority (peer_cache).",
    ),
    gauge(
        "kvtier_peer_handoff_pending",
        &[],
        Node,
        "Blocks owed to owners that missed them (hints), waiting to be handed off.",
    ),
    counter("kvtier_peer_handoff_sent_total", &[], Node, "Owed blocks handed off to their owners."),
    counter("kvtier_peer_handoff_given_up_total", &[], Node, "Owed blocks given up before they were handed off."),
    counter("kvtier_peer_hints_unsaved_total", &[], Node, "Failures to write the hints of owed blocks to disk."),
    gauge(
        "kvtier_peer_deletes_owed",
        &[],
        Node,
        "Namespace deletes (unregister, purge) owed to members that missed them.",
    ),
    counter(
        "kvtier_peer_deletes_retried_total",
        &[],
        Node,
        "Owed namespace deletes done on their member once it answered.",
    ),
    counter(
        "kvtier_peer_deletes_abandoned_total",
        &[],
        Node,
        "Owed namespace deletes given up (too many owed already, or still not done when their time ran out).",
    ),
    counter("kvtier_peer_deletes_unsaved_total", &[], Node, "Failures to write the owed namespace deletes to disk."),
    counter("kvtier_peer_rebalance_passes_total", &[], Node, "Rebalancing passes walked after the members changed."),
    counter("kvtier_peer_rebalance_queued_total", &[], Node, "Blocks rebalancing queued for a new owner."),
    counter(
        "kvtier_peer_rebalance_held_there_total",
        &[],
        Node,
        "Blocks rebalancing found their new owner held already (or were queued for it already).",
    ),
    counter(
        "kvtier_peer_rebalance_dropped_total",
        &[],
        Node,
        "Blocks rebalancing could not queue for their new owner (no room for hints).",
    ),
    counter(
        "kvtier_peer_rebalance_skipped_members_total",
        &[],
        Node,
        "New owners rebalancing left to the next pass (down, not answering, or not taking hints off the queue).",
    ),
    counter(
        "kvtier_peer_rebalance_raised_total",
        &[],
        Node,
        "Low-priority copies raised to normal priority because this node came to own their keys.",
    ),
    // The Redis tier.
    counter(
        "kvtier_redis_requests_total",
        &["op"],
        Node,
        "Pipelines the Redis tier sent, by `op` (get, exists, set, session_get, session_touch, session_del).",
    ),
    counter(
        "kvtier_redis_errors_total",
        &["op"],
        Node,
        "Failures of the Redis tier's commands, by `op` as in kvtier_redis_requests_total.",
    ),
    counter(
        "kvtier_redis_bad_values_total",
        &[],
        Node,
        "Values read from Redis that failed their checks (blocks or session manifests), taken as misses.",
    ),
    counter("kvtier_redis_written_keys_total", &[], Node, "Keys the Redis tier wrote."),
    counter(
        "kvtier_redis_write_dropped_total",
        &[],
        Node,
        "Blocks not written to Redis (the write queue full, or the write failed).",
    ),
    gauge("kvtier_redis_budget_used_bytes", &[], Node, "Bytes this node counts against its Redis budget now."),
    counter(
        "kvtier_redis_budget_refused_total",
        &[],
        Node,
        "Writes to Redis refused because they did not fit the node's Redis budget.",
    ),
    counter(
        "kvtier_redis_budget_evictions_total",
        &[],
        Node,
        "Keys deleted from Redis to stay within the node's Redis budget.",
    ),
    counter(
        "kvtier_redis_session_errors_total",
        &["op"],
        Node,
        "Sessions the Redis tier failed to share, by `op` (park).",
    ),
    counter("kvtier_redis_session_resumes_total", &[], Node, "Sessions resumed from a manifest shared in Redis."),
    // The client library.
    counter(
        "kvtier_client_bad_blocks_total",
        &[],
        Client,
        "Blocks a client loaded that failed their checksum or decode, reported as misses.",
    ),
    counter(
        "kvtier_client_misses_total",
        &["op", "reason"],
        Client,
        "Engine-client calls turned into misses, by `op` and `reason` (the error's class, e.g. timeout).",
    ),
    counter(
        "kvtier_client_pooled_connections_closed_total",
        &[],
        Client,
        "Idle pooled connections the server had closed, dropped before use.",
    ),
    counter(
        "kvtier_client_samenode_calls_total",
        &["op"],
        Client,
        "Shared-buffer calls served over the same-node socket, by `op` (load, store).",
    ),
    counter(
        "kvtier_client_samenode_fallback_total",
        &["reason"],
        Client,
        "Shared-buffer calls that went over TCP, not the same-node socket, by `reason` (e.g. other_host).",
    ),
    // The GPU agent (`kvtier agent`).
    gauge("kvtier_agent_pool_pages", &[], Agent, "Pages of the agent's G1 pools, over its devices."),
    gauge("kvtier_agent_pool_bytes", &[], Agent, "Bytes of the agent's G1 pools, over its devices."),
    gauge("kvtier_agent_resident_pages", &[], Agent, "G1 pages holding a block now."),
    gauge("kvtier_agent_resident_bytes", &[], Agent, "Bytes of the G1 pages holding a block now."),
    gauge("kvtier_agent_pinned_pages", &[], Agent, "G1 pages pinned now."),
    gauge("kvtier_agent_engine_connections", &[], Agent, "Engine connections open on the agent's socket now."),
    counter("kvtier_agent_requests_total", &[], Agent, "Engine requests the agent received."),
    counter("kvtier_agent_refused_total", &[], Agent, "Engine requests answered with an error status."),
    counter("kvtier_agent_evictions_total", &[], Agent, "Blocks evicted from G1."),
    counter("kvtier_agent_spills_total", &[], Agent, "Blocks evicted from G1 handed to the server (spilled)."),
    counter("kvtier_agent_spilled_bytes_total", &[], Agent, "Payload bytes of the blocks spilled from G1."),
    counter("kvtier_agent_spill_errors_total", &[], Agent, "Spills of blocks evicted from G1 that failed."),
    counter(
        "kvtier_agent_saved_blocks_total",
        &[],
        Agent,
        "Blocks whose last layer an engine saved (committed to G1).",
    ),
    counter(
        "kvtier_agent_saves_expired_total",
        &[],
        Agent,
        "Saves given up because their next layer did not come within save_timeout.",
    ),
    counter(
        "kvtier_agent_loaded_blocks_total",
        &["from"],
        Agent,
        "Blocks loaded for engines, by `from` (g1: the agent's pool; g2: fetched from the server).",
    ),
    counter(
        "kvtier_agent_load_misses_total",
        &[],
        Agent,
        "Keys engines asked to load that were in neither G1 nor the server (recomputed).",
    ),
    counter(
        "kvtier_agent_store_errors_total",
        &[],
        Agent,
        "Fetches from the server that failed (their keys became misses).",
    ),
    counter(
        "kvtier_agent_promotions_total",
        &[],
        Agent,
        "Blocks a load fetched from the server that were promoted into G1.",
    ),
    counter(
        "kvtier_agent_promotions_skipped_total",
        &[],
        Agent,
        "Blocks a load fetched from the server that were not promoted into G1 (no page free, or a copy failed).",
    ),
    counter("kvtier_agent_copy_bytes_total", &[], Agent, "Bytes moved by engine copies (saves and loads)."),
    gauge(
        "kvtier_agent_copy_gbps",
        &[],
        Agent,
        "Throughput of engine copies since the start, in GB/s (bytes copied over the time the copies took).",
    ),
    gauge(
        "kvtier_agent_lent_pages",
        &["lender"],
        Agent,
        "Pages of a device's pool holding other devices' blocks now, by `lender` (the device's ordinal).",
    ),
    gauge(
        "kvtier_agent_lent_bytes",
        &["lender"],
        Agent,
        "Bytes of a device's pool holding other devices' blocks now, by `lender` (the device's ordinal).",
    ),
    counter(
        "kvtier_agent_borrows_total",
        &["lender"],
        Agent,
        "Pages other devices borrowed from a device, by `lender` (the device's ordinal).",
    ),
    counter(
        "kvtier_agent_borrowed_bytes_total",
        &["lender"],
        Agent,
        "Bytes copied into borrowed pages, by `lender` (the device's ordinal).",
    ),
    counter("kvtier_agent_borrow_reclaims_total", &[], Agent, "Lent pages a lender took back for its own blocks."),
    counter(
        "kvtier_agent_borrow_declines_total",
        &["reason"],
        Agent,
        "Borrows declined, by `reason` (link_budget, no_peer_capacity, no_peer_access).",
    ),
    counter(
        "kvtier_agent_link_bytes_total",
        &["link"],
        Agent,
        "Bytes the agent moved over a link between devices, by `link` (lower-higher ordinal).",
    ),
    gauge(
        "kvtier_agent_link_use",
        &["link"],
        Agent,
        "Use of a device link now as the borrowing policy sees it (0 idle, 1 saturated), by `link`.",
    ),
    counter(
        "kvtier_agent_demand_spills_total",
        &[],
        Agent,
        "Blocks the server demanded that the agent spilled into the server's DRAM.",
    ),
    counter(
        "kvtier_agent_demand_not_resident_total",
        &[],
        Agent,
        "Blocks the server demanded that were no longer in G1.",
    ),
    counter(
        "kvtier_agent_demand_errors_total",
        &[],
        Agent,
        "Demanded blocks the agent failed to copy out of G1 or spill, and batches of demands that failed.",
    ),
    counter(
        "kvtier_agent_demand_stream_errors_total",
        &[],
        Agent,
        "Failures to open or read the server's demand stream.",
    ),
    counter(
        "kvtier_agent_reported_keys_total",
        &[],
        Agent,
        "Keys stored in, evicted from or dropped from G1 reported to the server.",
    ),
    counter("kvtier_agent_report_errors_total", &[], Agent, "Reports of G1 keys to the server that failed."),
    counter("kvtier_agent_lease_fetches_total", &[], Agent, "Blocks fetched from the server over the lease lane."),
    counter(
        "kvtier_agent_lease_spills_total",
        &["outcome"],
        Agent,
        "Spills over the lease lane, by `outcome` (placed, refused).",
    ),
    counter(
        "kvtier_agent_lease_lane_failures_total",
        &[],
        Agent,
        "Times the lease lane failed and was closed (blocks then move over the same-node socket).",
    ),
    counter(
        "kvtier_agent_namespaces_opened_offline_total",
        &[],
        Agent,
        "Namespaces engines opened while the server was unreachable (served from G1, registered later).",
    ),
    counter(
        "kvtier_agent_namespaces_registered_again_total",
        &[],
        Agent,
        "Namespaces registered with the server again because it no longer knew them (it restarted).",
    ),
];

/// Hands every metric's help text to the installed recorder, so each family it renders carries a
/// `# HELP` line. Describing a metric records nothing: it shows once it has a value.
pub fn describe_all() {
    for m in METRICS {
        match m.kind {
            MetricKind::Counter => metrics::describe_counter!(m.name, m.help),
            MetricKind::Gauge => metrics::describe_gauge!(m.name, m.help),
            MetricKind::Histogram => metrics::describe_histogram!(m.name, m.help),
        }
    }
}

/// Puts the label-less counters recorded by `by` in at 0, so that a scrape shows them before
/// their first event. Adds 0, so a counter that moved already keeps its count; counters with
/// labels and every gauge are left alone.
pub fn register_zeros(by: &[RecordedBy]) {
    for m in METRICS.iter().filter(|m| m.kind == MetricKind::Counter && m.labels.is_empty() && by.contains(&m.by)) {
        metrics::counter!(m.name).increment(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{BTreeMap, BTreeSet};
    use std::path::{Path, PathBuf};

    /// The source trees whose metrics the catalog must cover, relative to the workspace root.
    const SOURCE_DIRS: &[&str] = &["cache-server/src", "cli/src", "client/src", "gpu-agent/src"];

    /// What a file's place in the workspace says about the process recording its metrics.
    fn recorded_by(path: &str) -> RecordedBy {
        if path.starts_with("client/") {
            Client
        } else if path.starts_with("cli/src/agent") || path.starts_with("gpu-agent/") {
            Agent
        } else {
            // This crate, and the rest of the `kvtier` binary (`serve` and its peer transport).
            Node
        }
    }

    /// One token of Rust source, comments removed: a string literal's contents or one character.
    #[derive(Debug, PartialEq)]
    enum Tok {
        Str(String),
        Ch(char),
    }

    /// Whether the `r` at `i` may open a raw string (`r"…"`, `br"…"`): not the end of a name.
    fn raw_prefix_at(c: &[char], i: usize) -> bool {
        let ident = |k: usize| c[k].is_alphanumeric() || c[k] == '_';
        i == 0 || !ident(i - 1) || (c[i - 1] == 'b' && (i == 1 || !ident(i - 2)))
    }

    /// Tokens of `src` with their lines: string literals whole (escapes kept as written, raw
    /// strings included), comments dropped, char literals (so a `'"'` opens no string) kept as
    /// plain characters.
    fn tokens(src: &str) -> Vec<(Tok, usize)> {
        let c: Vec<char> = src.chars().collect();
        let (mut out, mut i, mut line) = (Vec::new(), 0, 1);
        while i < c.len() {
            let at = line;
            match c[i] {
                '/' if c.get(i + 1) == Some(&'/') => {
                    while i < c.len() && c[i] != '\n' {
                        i += 1;
                    }
                }
                '/' if c.get(i + 1) == Some(&'*') => {
                    let mut depth = 0;
                    while i < c.len() {
                        if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                            depth += 1;
                            i += 2;
                        } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                            depth -= 1;
                            i += 2;
                            if depth == 0 {
                                break;
                            }
                        } else {
                            line += usize::from(c[i] == '\n');
                            i += 1;
                        }
                    }
                }
                'r' if (c.get(i + 1) == Some(&'"') || c.get(i + 1) == Some(&'#')) && raw_prefix_at(&c, i) => {
                    let mut j = i + 1;
                    let mut hashes = 0;
                    while c.get(j) == Some(&'#') {
                        hashes += 1;
                        j += 1;
                    }
                    if c.get(j) != Some(&'"') {
                        out.push((Tok::Ch('r'), at));
                        i += 1;
                        continue;
                    }
                    let start = j + 1;
                    let mut k = start;
                    while k < c.len() && !(c[k] == '"' && (1..=hashes).all(|h| c.get(k + h) == Some(&'#'))) {
                        line += usize::from(c[k] == '\n');
                        k += 1;
                    }
                    out.push((Tok::Str(c[start..k.min(c.len())].iter().collect()), at));
                    i = k + 1 + hashes;
                }
                '"' => {
                    let mut k = i + 1;
                    while k < c.len() && c[k] != '"' {
                        k += if c[k] == '\\' { 2 } else { 1 };
                        line += usize::from(c[k - 1] == '\n');
                    }
                    out.push((Tok::Str(c[i + 1..k.min(c.len())].iter().collect()), at));
                    i = k + 1;
                }
                '\'' => {
                    // A char literal ('x', '\n', '\''); otherwise a lifetime's quote.
                    let end = if c.get(i + 1) == Some(&'\\') {
                        (i + 3..c.len()).find(|&k| c[k] == '\'')
                    } else if c.get(i + 2) == Some(&'\'') {
                        Some(i + 2)
                    } else {
                        None
                    };
                    out.push((Tok::Ch('\''), at));
                    i = end.map_or(i + 1, |e| e + 1);
                }
                ch => {
                    line += usize::from(ch == '\n');
                    out.push((Tok::Ch(ch), at));
                    i += 1;
                }
            }
        }
        out
    }

    /// A `counter!` / `gauge!` / `histogram!` call found in the source.
    #[derive(Debug)]
    struct Call {
        kind: MetricKind,
        /// The name when it is a string literal; `None` when it is built some other way.
        name: Option<String>,
        /// The label keys, sorted; `?` for an argument that is not `"key" => value`.
        labels: Vec<String>,
        line: usize,
        /// The name argument's token index, when a literal.
        name_at: Option<usize>,
    }

    fn is_ident_char(t: Option<&(Tok, usize)>) -> bool {
        matches!(t, Some((Tok::Ch(ch), _)) if ch.is_alphanumeric() || *ch == '_')
    }

    fn is_space(t: Option<&(Tok, usize)>) -> bool {
        matches!(t, Some((Tok::Ch(ch), _)) if ch.is_whitespace())
    }

    /// `a..b` without the whitespace at either end.
    fn trimmed(toks: &[(Tok, usize)], mut a: usize, mut b: usize) -> (usize, usize) {
        while a < b && is_space(toks.get(a)) {
            a += 1;
        }
        while b > a && is_space(toks.get(b - 1)) {
            b -= 1;
        }
        (a, b)
    }

    /// Whether `word!` starts at token `i` (and is not the end of a longer name, such as
    /// `describe_counter!`).
    fn macro_at(toks: &[(Tok, usize)], i: usize, word: &str) -> bool {
        let n = word.chars().count();
        (i == 0 || !is_ident_char(toks.get(i - 1)))
            && i + n < toks.len()
            && word.chars().zip(&toks[i..i + n]).all(|(w, (t, _))| *t == Tok::Ch(w))
            && toks[i + n].0 == Tok::Ch('!')
    }

    fn calls(toks: &[(Tok, usize)]) -> Vec<Call> {
        const MACROS: [(&str, MetricKind); 3] =
            [("counter", MetricKind::Counter), ("gauge", MetricKind::Gauge), ("histogram", MetricKind::Histogram)];
        let mut out = Vec::new();
        for i in 0..toks.len() {
            let Some((word, kind)) = MACROS.into_iter().find(|(word, _)| macro_at(toks, i, word)) else { continue };
            let mut open = i + word.len() + 1;
            while is_space(toks.get(open)) {
                open += 1;
            }
            if toks.get(open).map(|t| &t.0) != Some(&Tok::Ch('(')) {
                continue;
            }
            // The arguments, split at the commas outside any bracket.
            let (mut args, mut start, mut depth, mut k) = (Vec::new(), open + 1, 0usize, open + 1);
            while k < toks.len() {
                match toks[k].0 {
                    Tok::Ch('(' | '[' | '{') => depth += 1,
                    Tok::Ch(')' | ']' | '}') if depth == 0 => break,
                    Tok::Ch(')' | ']' | '}') => depth -= 1,
                    Tok::Ch(',') if depth == 0 => {
                        args.push(trimmed(toks, start, k));
                        start = k + 1;
                    }
                    _ => {}
                }
                k += 1;
            }
            args.push(trimmed(toks, start, k));
            args.retain(|(a, b)| a < b);
            let Some((&(a, b), rest)) = args.split_first() else { continue };
            let (name, name_at) = match &toks[a..b] {
                [(Tok::Str(s), _)] => (Some(s.clone()), Some(a)),
                _ => (None, None),
            };
            let mut labels: Vec<String> = rest
                .iter()
                .map(|&(a, b)| {
                    let (key_end, _) = trimmed(toks, a + 1, b);
                    match (&toks[a].0, toks.get(key_end).map(|t| &t.0), toks.get(key_end + 1).map(|t| &t.0)) {
                        (Tok::Str(key), Some(Tok::Ch('=')), Some(Tok::Ch('>'))) => key.clone(),
                        _ => "?".to_string(),
                    }
                })
                .collect();
            labels.sort();
            out.push(Call { kind, name, labels, line: toks[i].1, name_at });
        }
        out
    }

    fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else { panic!("cannot read {}", dir.display()) };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                rust_files(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }

    /// One place a metric is recorded.
    #[derive(Debug)]
    struct Use {
        name: String,
        kind: MetricKind,
        labels: Vec<String>,
        by: RecordedBy,
        at: String,
    }

    fn is_metric_name(s: &str) -> bool {
        s.strip_prefix("kvtier_").is_some_and(|r| {
            !r.is_empty() && r.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        })
    }

    /// Every place the workspace records a metric. A name given as a string literal to the macro
    /// is read there; a file that passes the macro a name held elsewhere (a variable, a field, a
    /// constant) has each of its other `"kvtier_…"` literals counted as a name of that macro, and
    /// `problems` gets a line when that can't be told (no such literal, or two such macros that
    /// differ in type or labels).
    fn scan(problems: &mut Vec<String>) -> Vec<Use> {
        let root = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
        let mut uses = Vec::new();
        for dir in SOURCE_DIRS {
            let mut files = Vec::new();
            rust_files(&root.join(dir), &mut files);
            files.sort();
            for file in files {
                let rel = file.strip_prefix(root).unwrap_or(&file).display().to_string();
                // This table names every metric, and `describe_all` passes them indirectly.
                if rel == "cache-server/src/metric_catalog.rs" {
                    continue;
                }
                let src = std::fs::read_to_string(&file).unwrap();
                let toks = tokens(&src);
                let found = calls(&toks);
                let by = recorded_by(&rel);
                let mut indirect: Vec<&Call> = Vec::new();
                let name_args: BTreeSet<usize> = found.iter().filter_map(|c| c.name_at).collect();
                for c in &found {
                    match &c.name {
                        Some(n) if is_metric_name(n) => uses.push(Use {
                            name: n.clone(),
                            kind: c.kind,
                            labels: c.labels.clone(),
                            by,
                            at: format!("{rel}:{}", c.line),
                        }),
                        Some(n) => problems.push(format!("{rel}:{}: a metric named {n:?}, not kvtier_…", c.line)),
                        None => indirect.push(c),
                    }
                }
                let Some(first) = indirect.first() else { continue };
                if indirect.iter().any(|c| c.kind != first.kind || c.labels != first.labels) {
                    problems.push(format!(
                        "{rel}: metric names passed indirectly to macros of different types or labels: {indirect:?}"
                    ));
                    continue;
                }
                let named: Vec<(String, usize)> = toks
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| !name_args.contains(i))
                    .filter_map(|(_, (t, line))| match t {
                        Tok::Str(s) if is_metric_name(s) => Some((s.clone(), *line)),
                        _ => None,
                    })
                    .collect();
                if named.is_empty() {
                    problems
                        .push(format!("{rel}:{}: a metric name passed indirectly, not found in the file", first.line));
                }
                for (name, line) in named {
                    uses.push(Use {
                        name,
                        kind: first.kind,
                        labels: first.labels.clone(),
                        by,
                        at: format!("{rel}:{line}"),
                    });
                }
            }
        }
        uses
    }

    #[test]
    fn the_catalog_lists_every_metric_recorded_and_only_those() {
        let mut problems = Vec::new();
        let uses = scan(&mut problems);
        let mut catalog: BTreeMap<&str, &MetricDoc> = BTreeMap::new();
        for m in METRICS {
            if catalog.insert(m.name, m).is_some() {
                problems.push(format!("{} is in METRICS twice", m.name));
            }
            if !is_metric_name(m.name) || m.help.trim().is_empty() || !m.help.ends_with('.') {
                problems.push(format!("{}: a kvtier_ name and a help sentence ending in '.' wanted", m.name));
            }
        }
        let mut missing: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for u in &uses {
            let Some(m) = catalog.get(u.name.as_str()) else {
                missing.entry(&u.name).or_default().push(&u.at);
                continue;
            };
            let mut labels: Vec<&str> = m.labels.to_vec();
            labels.sort();
            if m.kind != u.kind || labels != u.labels || m.by != u.by {
                problems.push(format!(
                    "{}: recorded at {} as {:?} {:?} by {:?}; METRICS has {:?} {:?} by {:?}",
                    u.name, u.at, u.kind, u.labels, u.by, m.kind, labels, m.by
                ));
            }
        }
        for (name, at) in &missing {
            problems.push(format!("not in METRICS: {name} (recorded at {})", at.join(", ")));
        }
        let used: BTreeSet<&str> = uses.iter().map(|u| u.name.as_str()).collect();
        for m in METRICS.iter().filter(|m| !used.contains(m.name)) {
            problems.push(format!("in METRICS but recorded nowhere: {}", m.name));
        }
        assert!(problems.is_empty(), "{} problem(s) with the metric catalog:\n{}", problems.len(), problems.join("\n"));
    }

    #[test]
    fn the_scan_reads_names_labels_and_indirect_names() {
        let src = r#"
            // counter!("kvtier_in_a_comment_total").increment(1);
            let c = '"';
            metrics::counter!(
                "kvtier_a_total", "op" => op, "kind" => k.as_str()
            ).increment(1);
            ::metrics::describe_counter!("kvtier_described", "not a use");
            gauge!("kvtier_b", "x" => format!("{a}-{b}")).set(1.0);
            histogram!("kvtier_c_seconds").record(0.1);
        "#;
        let found = calls(&tokens(src));
        let got: Vec<_> = found.iter().map(|c| (c.kind, c.name.as_deref(), c.labels.clone(), c.line)).collect();
        assert_eq!(
            got,
            vec![
                (MetricKind::Counter, Some("kvtier_a_total"), vec!["kind".to_string(), "op".to_string()], 4),
                (MetricKind::Gauge, Some("kvtier_b"), vec!["x".to_string()], 8),
                (MetricKind::Histogram, Some("kvtier_c_seconds"), vec![], 9),
            ]
        );
        let indirect = calls(&tokens(
            "let k = if a { \"kvtier_x_total\" } else { \"kvtier_y_total\" };\ncounter!(k).increment(1);",
        ));
        assert_eq!(indirect.len(), 1);
        assert_eq!((indirect[0].name.as_deref(), indirect[0].line), (None, 2));
    }

    /// The metrics a rendered scrape types (`# TYPE`), and those it describes (`# HELP`).
    fn families(text: &str) -> (BTreeSet<String>, BTreeSet<String>) {
        let name = |prefix: &str| -> BTreeSet<String> {
            text.lines().filter_map(|l| l.strip_prefix(prefix)?.split(' ').next().map(str::to_string)).collect()
        };
        (name("# TYPE "), name("# HELP "))
    }

    #[test]
    fn described_metrics_render_their_help_and_label_less_counters_start_at_zero() {
        use metrics_exporter_prometheus::PrometheusBuilder;
        let recorder = PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            describe_all();
            register_zeros(&[Node, Client]);
        });
        let text = handle.render();
        let (typed, helped) = families(&text);
        assert!(text.contains("# HELP kvtier_disk_compactions_total Disk segments compacted to make room"), "{text}");
        assert!(text.lines().any(|l| l == "kvtier_disk_compactions_total 0"), "{text}");
        assert!(text.lines().any(|l| l == "kvtier_client_bad_blocks_total 0"), "{text}");
        // Every label-less counter of the node and the client, and nothing else.
        let zeroed: BTreeSet<String> = METRICS
            .iter()
            .filter(|m| m.kind == MetricKind::Counter && m.labels.is_empty() && m.by != Agent)
            .map(|m| m.name.to_string())
            .collect();
        assert_eq!(typed, zeroed);
        assert_eq!(helped, zeroed, "each with its help");
        // Not a counter recorded only with labels, nor a gauge, nor the agent's counters.
        assert!(!text.contains("kvtier_errors_total"), "{text}");
        assert!(!text.contains("kvtier_sessions "), "{text}");
        assert!(!text.contains("kvtier_agent_requests_total"), "{text}");

        metrics::with_local_recorder(&recorder, || {
            metrics::counter!("kvtier_disk_compactions_total").increment(2);
            metrics::counter!("kvtier_errors_total", "kind" => "io").increment(1);
            metrics::gauge!("kvtier_sessions").set(3.0);
            metrics::histogram!("kvtier_disk_read_seconds").record(0.001);
            // Again, as a node opened later would: a count already there stays.
            register_zeros(&[Node]);
        });
        let text = handle.render();
        assert!(text.lines().any(|l| l == "kvtier_disk_compactions_total 2"), "{text}");
        assert!(text.lines().any(|l| l == "kvtier_errors_total{kind=\"io\"} 1"), "{text}");
        assert!(text.lines().any(|l| l == "kvtier_sessions 3"), "{text}");
        assert!(text.contains("# HELP kvtier_errors_total Errors by `kind`"), "{text}");
        assert!(text.contains("# HELP kvtier_sessions Parked sessions held on this node now."), "{text}");
        assert!(text.contains("# HELP kvtier_disk_read_seconds Time to read one block"), "{text}");
        let (typed, helped) = families(&text);
        assert_eq!(typed, helped, "every family rendered has its help");
    }
}
