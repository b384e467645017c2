//! The lab's credentials, made fresh for every run as kubeadm makes a cluster's: a CA, the API
//! server's serving certificate signed by it (for the control plane's node address), bearer
//! tokens in kube-apiserver's `--token-auth-file` format, and one kubeconfig per client.

use std::io::Read;
use std::net::IpAddr;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType,
};

/// A CA and a serving certificate it signed, PEM-encoded.
#[derive(Debug, Clone)]
pub struct ServingCert {
    /// The CA certificate clients trust (`certificate-authority`).
    pub ca_pem: String,
    /// The API server's certificate (`--tls-cert-file`).
    pub cert_pem: String,
    /// Its private key (`--tls-private-key-file`).
    pub key_pem: String,
}

/// Issues a CA named for the lab and a serving certificate for `dns` names and `ips`.
pub fn serving_cert(lab: &str, dns: &[&str], ips: &[IpAddr]) -> Result<ServingCert, rcgen::Error> {
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, format!("nodeport lab {lab} CA"));
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_key = KeyPair::generate()?;
    let ca_cert = ca.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca, ca_key);

    let mut server =
        CertificateParams::new(dns.iter().map(|d| (*d).to_owned()).collect::<Vec<_>>())?;
    server
        .subject_alt_names
        .extend(ips.iter().map(|ip| SanType::IpAddress(*ip)));
    server
        .distinguished_name
        .push(DnType::CommonName, "kube-apiserver");
    let server_key = KeyPair::generate()?;
    let server_cert = server.signed_by(&server_key, &issuer)?;
    Ok(ServingCert {
        ca_pem: ca_cert.pem(),
        cert_pem: server_cert.pem(),
        key_pem: server_key.serialize_pem(),
    })
}

/// A bearer token: 32 hex digits from the kernel's random source.
pub fn token() -> std::io::Result<String> {
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// One line of a `--token-auth-file`: `token,user,uid,"group1,group2"`.
pub fn token_line(token: &str, user: &str, groups: &[&str]) -> String {
    format!("{token},{user},{user},\"{}\"\n", groups.join(","))
}

/// A kubeconfig for `server`, trusting the CA file `ca` and authenticating with `token`.
pub fn kubeconfig(server: &str, ca: &str, user: &str, token: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: nodeport-lab\n  cluster:\n    server: \
         {server}\n    certificate-authority: {ca}\ncontexts:\n- name: {user}@nodeport-lab\n  \
         context:\n    cluster: nodeport-lab\n    user: {user}\ncurrent-context: \
         {user}@nodeport-lab\nusers:\n- name: {user}\n  user:\n    token: {token}\n"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_serving_cert_is_signed_by_the_ca_for_the_node_address() {
        let ip: IpAddr = "192.0.2.10".parse().unwrap();
        let pki = serving_cert("abcde", &["control-plane"], &[ip]).unwrap();
        assert!(pki.ca_pem.starts_with("-----BEGIN CERTIFICATE-----"));
        assert!(pki.cert_pem.starts_with("-----BEGIN CERTIFICATE-----"));
        assert!(pki.key_pem.starts_with("-----BEGIN PRIVATE KEY-----"));
        assert_ne!(pki.ca_pem, pki.cert_pem);
    }

    #[test]
    fn tokens_are_fresh_hex_and_lines_follow_the_token_auth_file_format() {
        let (a, b) = (token().unwrap(), token().unwrap());
        assert_eq!(a.len(), 32);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
        assert_eq!(
            token_line("t0k", "kube-proxy", &["system:node-proxier"]),
            "t0k,kube-proxy,kube-proxy,\"system:node-proxier\"\n"
        );
    }

    #[test]
    fn the_kubeconfig_names_server_ca_and_token() {
        let text = kubeconfig("https://192.0.2.10:6443", "/x/ca.pem", "admin", "t0k");
        assert!(text.contains("    server: https://192.0.2.10:6443\n"));
        assert!(text.contains("    certificate-authority: /x/ca.pem\n"));
        assert!(text.contains("current-context: admin@nodeport-lab\n"));
        assert!(text.contains("    token: t0k\n"));
    }
}
