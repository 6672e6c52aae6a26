//! The replay of the node's metadata logs over arbitrary bytes: the first byte picks
//! `sessions.log` (0 mod 4), `namespaces.log` (1), `owed_deletes.log` (2) or `peer_hints.log`
//! (3), the rest is the file. The functions are the
//! server's own (`kvtier_proto::record_log`: header, keyed-record scan, record bodies). Beyond not
//! panicking: every record returned is, byte for byte, the record its body encodes to under the
//! file's secret (so it verifies); records never overlap and never outnumber what fits; damaged
//! stretches are separated by records, and a file that is all records has none; decoded bodies
//! round-trip; and the records re-written as a clean file read back the same with nothing skipped.
#![no_main]

use kvtier_proto::record_log::deletes::{self, read_owed_deletes_log, OwedDeleteRecord};
use kvtier_proto::record_log::hints::{self, read_peer_hints_log, PeerHintsRecord};
use kvtier_proto::record_log::namespaces::{self, read_namespace_log, NamespaceRecord};
use kvtier_proto::record_log::sessions::{self, decode_body, encode_body, read_session_log};
use kvtier_proto::record_log::{
    encode_log_header, encode_record, read_log, LogContents, LogKind, LOG_HEADER_LEN, LOG_HEADER_MAGIC,
    RECORD_HEADER_LEN,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&pick, file)) = data.split_first() else { return };
    let (kind, max) = match pick % 4 {
        0 => (LogKind::Sessions, sessions::MAX_RECORD),
        1 => (LogKind::Namespaces, namespaces::MAX_RECORD),
        2 => (LogKind::OwedDeletes, deletes::MAX_RECORD),
        _ => (LogKind::PeerHints, hints::MAX_RECORD),
    };
    if matches!(kind, LogKind::OwedDeletes | LogKind::PeerHints) {
        // These logs have no first format: a file without a header is refused, an empty one owes nothing.
        let read = match kind {
            LogKind::OwedDeletes => read_owed_deletes_log(file).map(|(r, s)| (r.len(), s)),
            _ => read_peer_hints_log(file).map(|(r, s)| (r.len(), s)),
        };
        match read_log(kind, file, max) {
            Ok(LogContents::Legacy) if !file.is_empty() => assert!(read.is_err(), "a file with no header read"),
            Ok(LogContents::Legacy) => assert_eq!(read.ok(), Some((0, 0))),
            Ok(LogContents::Keyed { .. }) => assert!(read.is_ok(), "a keyed file refused"),
            Err(_) => assert!(read.is_err(), "a damaged header read"),
        }
    }
    let (key, scan) = match read_log(kind, file, max) {
        Err(_) => {
            let copy = LOG_HEADER_LEN / 2;
            assert!(
                file.starts_with(&LOG_HEADER_MAGIC) || file.get(copy..copy + 8) == Some(&LOG_HEADER_MAGIC[..]),
                "refused a file with no header"
            );
            return;
        }
        Ok(LogContents::Legacy) => {
            assert!(!file.starts_with(&LOG_HEADER_MAGIC), "a header read as none");
            return;
        }
        Ok(LogContents::Keyed { key, scan }) => (key, scan),
    };
    // A file may end inside the header's second copy (the first one verified).
    let room = file.len().saturating_sub(LOG_HEADER_LEN) / RECORD_HEADER_LEN;
    assert!(scan.records.len() <= room, "{} records in room for {room}", scan.records.len());
    assert!(scan.skipped <= scan.records.len() as u64 + 1, "adjacent damaged stretches counted apart");
    let mut next = LOG_HEADER_LEN.min(file.len());
    let mut gaps = false;
    for (offset, body) in &scan.records {
        assert!(*offset >= next, "records overlap");
        gaps |= *offset > next;
        let rec = encode_record(&key, body);
        assert_eq!(file.get(*offset..offset + rec.len()), Some(&rec[..]), "a returned record does not verify");
        next = offset + rec.len();
    }
    gaps |= next != file.len();
    assert_eq!(gaps, scan.skipped > 0, "skipped {} with gaps {gaps}", scan.skipped);
    let mut clean = encode_log_header(kind, &key);
    for (_, body) in &scan.records {
        clean.extend(encode_record(&key, body));
    }
    match read_log(kind, &clean, max) {
        Ok(LogContents::Keyed { scan: again, .. }) => {
            assert_eq!(again.skipped, 0);
            let bodies =
                |s: &kvtier_proto::record_log::LogScan<'_>| s.records.iter().map(|r| r.1.to_vec()).collect::<Vec<_>>();
            assert_eq!(bodies(&again), bodies(&scan), "a clean rewrite reads back different records");
        }
        other => panic!("a clean rewrite read as {other:?}"),
    }
    let total = scan.records.len() as u64 + scan.skipped;
    match kind {
        LogKind::Sessions => {
            let (records, skipped) = read_session_log(file).expect("header read above").expect("keyed");
            assert_eq!(records.len() as u64 + skipped, total, "records and skips do not add up");
            for (kind, seq, s) in records {
                let body = encode_body(kind, seq, &s);
                assert_eq!(decode_body(&body, 0), Some((kind, seq, s)), "a session record does not round-trip");
            }
        }
        LogKind::Namespaces => {
            let (records, skipped) = read_namespace_log(file).expect("header read above").expect("keyed");
            assert_eq!(records.len() as u64 + skipped, total, "records and skips do not add up");
            for r in records {
                assert_eq!(
                    NamespaceRecord::decode(&r.encode()),
                    Some(r.clone()),
                    "a namespace record does not round-trip"
                );
            }
        }
        LogKind::OwedDeletes => {
            let (records, skipped) = read_owed_deletes_log(file).expect("header read above");
            assert_eq!(records.len() as u64 + skipped, total, "records and skips do not add up");
            for r in records {
                let body = r.encode();
                assert_eq!(OwedDeleteRecord::decode(&body), Some(r), "an owed-delete record does not round-trip");
            }
        }
        LogKind::PeerHints => {
            let (records, skipped) = read_peer_hints_log(file).expect("header read above");
            assert_eq!(records.len() as u64 + skipped, total, "records and skips do not add up");
            for r in records {
                let body = r.encode();
                assert_eq!(PeerHintsRecord::decode(&body), Some(r), "a peer-hints record does not round-trip");
            }
        }
    }
});
