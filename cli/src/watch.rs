//! `kvtier events` and `kvtier route`: a node's KV events, one line each, and the routing hint
//! for a token sequence (which nodes hold how long a prefix, and the session).

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

use crate::{connect, connect_client, connect_existing, ConnArgs, NO_SUCH_NAMESPACE};

#[derive(Args)]
pub struct EventsArgs {
    #[command(flatten)]
    conn: ConnArgs,
    /// Watch every namespace the credential may read instead of the one given by the
    /// namespace flags (the operator: all of them).
    #[arg(long)]
    all: bool,
    /// Stop after this many events (default: until interrupted).
    #[arg(long)]
    count: Option<u64>,
}

#[derive(Args)]
pub struct RouteArgs {
    #[command(flatten)]
    conn: ConnArgs,
    /// Text whose UTF-8 bytes are the token ids (as `put`, `get` and `session` take it).
    #[arg(long, conflicts_with_all = ["tokens", "tokens_file"])]
    text: Option<String>,
    /// File of token ids, separated by commas or white space.
    #[arg(long, conflicts_with = "tokens")]
    tokens_file: Option<PathBuf>,
    /// Comma-separated token ids.
    #[arg(long, value_delimiter = ',')]
    tokens: Option<Vec<u32>>,
    /// Also report which nodes hold this session.
    #[arg(long)]
    session: Option<String>,
}

/// Prints one line per event: node, sequence, kind, namespace, then the kind's details.
pub async fn events(a: EventsArgs) -> anyhow::Result<()> {
    // With --all no namespace is named, so none is registered: a tenant's credential may not
    // register the default `cli` tenant's namespace, and needs none to watch its own.
    let (mut watch, what) = if a.all {
        let w = connect_client(&a.conn.node).await?.watch_events(&[]).await?;
        (w, "every namespace this credential may read".to_string())
    } else {
        let (client, ns) = connect(&a.conn).await?;
        let w = client.watch_events(&[&ns]).await?;
        let n = &ns.namespace;
        (w, format!("ns={} (tenant {:?}, model {:?})", ns.id.to_hex(), n.tenant, n.model))
    };
    // Said on stderr (stdout carries events only): a namespace nothing stores into yet is quiet,
    // and a typo in a flag names one nothing ever will.
    eprintln!("watching {what} on {}: one line per event, until interrupted", a.conn.node.server);
    let mut seen = 0u64;
    while a.count.is_none_or(|n| seen < n) {
        let e = match watch.next().await {
            Ok(Some(e)) => e,
            // The node ended the stream: it is stopping. Said on stderr, so a script reading the
            // events isn't fed a line that is not one.
            Ok(None) => {
                eprintln!("the node closed the event stream (it is stopping) after {seen} event(s)");
                break;
            }
            Err(e) => {
                return Err(anyhow::Error::new(e).context(format!("the event stream broke after {seen} event(s)")))
            }
        };
        seen += 1;
        let ns = e.namespace.map(|n| n.to_hex()).unwrap_or_else(|| "-".into());
        let detail = match e.kind {
            kvtier_client::EventKind::Lagged => format!("missed={}", e.missed),
            kvtier_client::EventKind::SessionParked
            | kvtier_client::EventKind::SessionDropped
            | kvtier_client::EventKind::SessionExpired => format!("session={}", e.session_id),
            _ => {
                let keys: Vec<String> = e.keys.iter().map(|k| k.to_string()).collect();
                let to = if e.to_tier.is_empty() { String::new() } else { format!(" to={}", e.to_tier) };
                format!("tier={}{to} keys={} [{}]", e.tier, e.keys.len(), keys.join(","))
            }
        };
        outln!("{} {} {} ns={ns} {detail}", e.node_id, e.seq, e.kind.as_str())?;
    }
    Ok(())
}

/// Prints the hint: one line per node, the best node last.
pub async fn route(a: RouteArgs) -> anyhow::Result<()> {
    let tokens: Vec<u32> = match (&a.text, &a.tokens_file, &a.tokens) {
        (Some(t), None, None) => t.bytes().map(u32::from).collect(),
        (None, Some(p), None) => {
            let text = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            text.split(|c: char| c == ',' || c.is_whitespace())
                .filter(|s| !s.is_empty())
                .map(|s| s.parse::<u32>().with_context(|| format!("{}: {s:?} is not a token id", p.display())))
                .collect::<anyhow::Result<_>>()?
        }
        (None, None, Some(t)) => t.clone(),
        _ => anyhow::bail!("give the tokens with --text, --tokens or --tokens-file"),
    };
    // A read: a namespace the node does not know is not registered by asking (as `lookup`).
    let (client, ns) = connect_existing(&a.conn).await?;
    let hint = match client.route_hint(&ns, &tokens, a.session.as_deref()).await {
        Err(kvtier_client::ClientError::UnknownNamespace(_)) => {
            outln!("{} tokens: note: {NO_SUCH_NAMESPACE}", tokens.len())?;
            return Ok(());
        }
        other => other?,
    };
    outln!(
        "{} tokens: {} full blocks of {} tokens{}",
        tokens.len(),
        hint.total_blocks,
        hint.block_tokens,
        if hint.membership_stale { " (membership stale)" } else { "" }
    )?;
    for n in &hint.nodes {
        if n.reachable {
            let session = match (&a.session, n.holds_session) {
                (Some(_), true) => format!(" session={} tokens", n.session_tokens),
                (Some(_), false) => " session=no".into(),
                (None, _) => String::new(),
            };
            outln!(
                "node {} grpc={} prefix={} blocks ({} tokens){session}",
                n.node_id,
                n.grpc_addr,
                n.prefix_blocks,
                n.prefix_tokens
            )?;
        } else {
            outln!("node {} grpc={} unknown: {}", n.node_id, n.grpc_addr, n.error.as_deref().unwrap_or(""))?;
        }
    }
    match hint.best() {
        Some(b) => outln!("best {} {}", b.node_id, b.grpc_addr)?,
        None => outln!("best none")?,
    }
    Ok(())
}
