//! `kvtier cert`: a small CA for a kvtier deployment — the CA's certificate and key, node
//! certificates (the names and addresses clients reach a node by; nodes also present them to
//! each other) and client certificates, whose names a tenant lists in `cert_names` (or
//! `tls.operator_names`). Bring your own CA instead where one exists: the node only reads PEM.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::Subcommand;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};

/// The CA's subject: fixed, so the CA's certificate need not be parsed to sign with its key.
const CA_NAME: &str = "kvtier CA";

#[derive(Subcommand)]
pub enum CertCmd {
    /// Create a CA in DIR: ca.pem (give it to clients and nodes) and ca.key (keep it private).
    Ca {
        #[arg(long)]
        dir: PathBuf,
        /// Days of validity: 1 to 36500.
        #[arg(long, default_value_t = 3650, value_parser = clap::value_parser!(u32).range(1..=36500))]
        days: u32,
    },
    /// A node certificate signed by DIR's CA: DIR/NAME.pem and DIR/NAME.key, valid for every
    /// --host (DNS names or IP addresses clients connect to), for serving and between nodes.
    Node {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long)]
        name: String,
        #[arg(long = "host", required = true)]
        hosts: Vec<String>,
        /// Days of validity: 1 to 36500.
        #[arg(long, default_value_t = 825, value_parser = clap::value_parser!(u32).range(1..=36500))]
        days: u32,
    },
    /// A client certificate signed by DIR's CA naming NAME (a DNS-style name, or a URI such as
    /// spiffe://fleet/engine-a): DIR/NAME.pem and DIR/NAME.key (a URI's name is made file-safe).
    Client {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long)]
        name: String,
        /// Days of validity: 1 to 36500.
        #[arg(long, default_value_t = 825, value_parser = clap::value_parser!(u32).range(1..=36500))]
        days: u32,
    },
}

fn ca_params(days: u32) -> CertificateParams {
    let mut p = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, CA_NAME);
    p.distinguished_name = dn;
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    validity(&mut p, days);
    p
}

fn validity(p: &mut CertificateParams, days: u32) {
    let now = rcgen::date_time_ymd(1970, 1, 1) + std::time::Duration::from_secs(unix_now());
    // An hour of slack for clocks a little behind.
    p.not_before = now - std::time::Duration::from_secs(3600);
    p.not_after = now + std::time::Duration::from_secs(u64::from(days) * 86_400);
}

fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Writes `text` to a new file (never over an existing one); keys readable by their owner only.
fn write_new(path: &Path, text: &str, private: bool) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(if private { 0o600 } else { 0o644 })
        .open(path)
        .with_context(|| format!("creating {} (an existing file is never replaced)", path.display()))?;
    f.write_all(text.as_bytes())?;
    f.sync_all()?;
    Ok(())
}

fn load_issuer(dir: &Path) -> anyhow::Result<Issuer<'static, KeyPair>> {
    let key_path = dir.join("ca.key");
    let pem = std::fs::read_to_string(&key_path)
        .with_context(|| format!("reading {} (create a CA first: kvtier cert ca --dir ...)", key_path.display()))?;
    let key = KeyPair::from_pem(&pem).with_context(|| format!("{}: not a PEM private key", key_path.display()))?;
    Ok(Issuer::new(ca_params(1), key))
}

fn file_stem(name: &str) -> String {
    name.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' { c } else { '_' }).collect()
}

fn san(name: &str) -> anyhow::Result<SanType> {
    if let Ok(ip) = name.parse::<std::net::IpAddr>() {
        return Ok(SanType::IpAddress(ip));
    }
    if name.contains("://") {
        return Ok(SanType::URI(name.try_into().with_context(|| format!("{name:?} is not an ASCII URI"))?));
    }
    Ok(SanType::DnsName(name.try_into().with_context(|| format!("{name:?} is not a DNS-style name"))?))
}

fn leaf(
    dir: &Path,
    name: &str,
    sans: &[String],
    usages: Vec<ExtendedKeyUsagePurpose>,
    days: u32,
) -> anyhow::Result<()> {
    if name.is_empty() {
        bail!("--name must not be empty");
    }
    let issuer = load_issuer(dir)?;
    let mut p = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, name);
    p.distinguished_name = dn;
    p.subject_alt_names = sans.iter().map(|s| san(s)).collect::<anyhow::Result<_>>()?;
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
    p.extended_key_usages = usages;
    p.use_authority_key_identifier_extension = true;
    validity(&mut p, days);
    let key = KeyPair::generate()?;
    let cert = p.signed_by(&key, &issuer)?;
    let stem = file_stem(name);
    write_new(&dir.join(format!("{stem}.key")), &key.serialize_pem(), true)?;
    write_new(&dir.join(format!("{stem}.pem")), &cert.pem(), false)?;
    outln!("wrote {0}/{stem}.pem and {0}/{stem}.key (names: {1})", dir.display(), sans.join(", "))?;
    Ok(())
}

pub fn run(cmd: CertCmd) -> anyhow::Result<()> {
    match cmd {
        CertCmd::Ca { dir, days } => {
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            let key = KeyPair::generate()?;
            let cert = ca_params(days).self_signed(&key)?;
            write_new(&dir.join("ca.key"), &key.serialize_pem(), true)?;
            write_new(&dir.join("ca.pem"), &cert.pem(), false)?;
            outln!("wrote {0}/ca.pem and {0}/ca.key", dir.display())?;
            Ok(())
        }
        CertCmd::Node { dir, name, hosts, days } => leaf(
            &dir,
            &name,
            &hosts,
            vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth],
            days,
        ),
        CertCmd::Client { dir, name, days } => {
            leaf(&dir, &name, std::slice::from_ref(&name), vec![ExtendedKeyUsagePurpose::ClientAuth], days)
        }
    }
}
