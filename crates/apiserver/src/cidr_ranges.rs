//! ClusterIPs across ServiceCIDRs: the flag's ranges (the default ServiceCIDR `kubernetes`,
//! kept in the kube-apiserver bitmaps) and the ServiceCIDRs added through the API.
//!
//! kube-apiserver 1.33 (MultiCIDRServiceAllocator, KEP-1880) keeps one allocator per CIDR of
//! every ServiceCIDR (`pkg/registry/core/service/ipallocator/cidrallocator.go`,
//! `MetaAllocator`):
//!
//! - an address asked for is taken if a Ready ServiceCIDR of its family contains it;
//! - a dynamic pick tries the Ready ranges of the family one after the other, in no defined
//!   order (it walks a Go map), each with its own static and dynamic band (KEP-3070);
//! - a ServiceCIDR being deleted (or not Ready) takes no new address, but its addresses are
//!   released as usual.
//!
//! Here every allocated address is recorded in exactly one place, so overlapping ServiceCIDRs
//! never hand out one address twice: in the flag's bitmap of its family when it lies in the
//! flag's range (the bitmap kube-apiserver 1.33 still dual-writes), else in
//! [`ExtraRanges::allocated`]. [`ExtraRanges`] is one stored document,
//! `<prefix>/ranges/servicecidrs`, read and compared by every write like the bitmaps, so
//! allocation stays atomic with the Service's save on both stores and across API servers.
//! (kube-apiserver records each address as an IPAddress object instead; this server does not
//! serve IPAddresses yet.)

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use nodeport_alloc::ip;
use serde::{Deserialize, Serialize};

/// The ServiceCIDRs added through the API and the addresses allocated outside the flag's
/// ranges.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExtraRanges {
    /// Each added ServiceCIDR by name.
    #[serde(default)]
    pub service_cidrs: BTreeMap<String, ExtraCidr>,
    /// Allocated ClusterIPs outside the flag's ranges.
    #[serde(default)]
    pub allocated: BTreeSet<IpAddr>,
}

/// One added ServiceCIDR, as allocation sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExtraCidr {
    /// Its CIDRs (one per family).
    pub cidrs: Vec<IpNet>,
    /// Whether it gives out addresses: Ready and not being deleted.
    pub ready: bool,
}

impl ExtraRanges {
    /// Decodes the stored document.
    pub fn decode(value: &[u8]) -> Result<Self, String> {
        serde_json::from_slice(value).map_err(|e| format!("not a ServiceCIDR allocation: {e}"))
    }

    /// Encodes the document for storage.
    pub fn encode(&self) -> Arc<[u8]> {
        serde_json::to_vec(self).expect("serializes as JSON").into()
    }

    /// The Ready added CIDRs of a family.
    pub fn ready_cidrs(&self, ipv6: bool) -> Vec<IpNet> {
        let mut cidrs: Vec<IpNet> = self
            .service_cidrs
            .values()
            .filter(|c| c.ready)
            .flat_map(|c| c.cidrs.iter().copied())
            .filter(|c| c.addr().is_ipv6() == ipv6)
            .collect();
        cidrs.sort();
        cidrs.dedup();
        cidrs
    }
}

/// The flag's allocator that records `ip`, if `ip` is one of its usable addresses.
fn flag_allocator<'a>(
    primary: &'a mut ip::Allocator,
    secondary: Option<&'a mut ip::Allocator>,
    ip: IpAddr,
) -> Option<&'a mut ip::Allocator> {
    if in_usable(primary, ip) {
        return Some(primary);
    }
    secondary.filter(|a| in_usable(a, ip))
}

/// Whether `ip` is a usable address of `allocator`'s range (allocate or release would act).
fn in_usable(allocator: &ip::Allocator, ip: IpAddr) -> bool {
    allocator.is_usable(ip)
}

/// The allocation state over every range: the flag's bitmaps and the added ServiceCIDRs.
pub struct View<'a> {
    /// The flag's primary range.
    pub primary: &'a mut ip::Allocator,
    /// The flag's secondary range, on a dual-stack server.
    pub secondary: Option<&'a mut ip::Allocator>,
    /// The added ServiceCIDRs.
    pub extra: &'a mut ExtraRanges,
}

impl View<'_> {
    fn flag_of_family(&mut self, ipv6: bool) -> Option<&mut ip::Allocator> {
        if self.primary.cidr().addr().is_ipv6() == ipv6 {
            return Some(self.primary);
        }
        self.secondary
            .as_deref_mut()
            .filter(|a| a.cidr().addr().is_ipv6() == ipv6)
    }

    /// Whether `ip` is allocated, wherever it is recorded.
    pub fn has(&mut self, ip: IpAddr) -> bool {
        match flag_allocator(self.primary, self.secondary.as_deref_mut(), ip) {
            Some(a) => a.has(ip),
            None => self.extra.allocated.contains(&ip),
        }
    }

    /// Takes `ip`, asked for by a Service: in the flag's range as the bitmap allocator does,
    /// or in a Ready added ServiceCIDR. Outside all of them: the flag range's `NotInRange`.
    pub fn allocate(&mut self, ip: IpAddr) -> Result<(), ip::Error> {
        let ready_extra = self
            .extra
            .ready_cidrs(ip.is_ipv6())
            .iter()
            .any(|c| c.contains(&ip));
        if let Some(a) = flag_allocator(self.primary, self.secondary.as_deref_mut(), ip) {
            return a.allocate(ip);
        }
        if ready_extra {
            return if self.extra.allocated.insert(ip) {
                Ok(())
            } else {
                Err(ip::Error::Allocated)
            };
        }
        match self.flag_of_family(ip.is_ipv6()) {
            Some(a) => a.allocate(ip),
            None => Err(ip::Error::NotInRange {
                ip,
                range: self.primary.cidr().to_string(),
            }),
        }
    }

    /// Records `ip` as allocated without any readiness check (rebuilding from the Services).
    pub fn record(&mut self, ip: IpAddr) -> Result<(), ip::Error> {
        match flag_allocator(self.primary, self.secondary.as_deref_mut(), ip) {
            Some(a) => a.allocate(ip),
            None if self
                .extra
                .service_cidrs
                .values()
                .flat_map(|c| &c.cidrs)
                .any(|c| c.contains(&ip)) =>
            {
                if self.extra.allocated.insert(ip) {
                    Ok(())
                } else {
                    Err(ip::Error::Allocated)
                }
            }
            None => Err(ip::Error::NotInRange {
                ip,
                range: self.primary.cidr().to_string(),
            }),
        }
    }

    /// Picks a free address of the family from the Ready ranges, tried in a random order as
    /// kube-apiserver's `MetaAllocator` tries its map of allocators.
    pub fn allocate_next(&mut self, ipv6: bool) -> Result<IpAddr, ip::Error> {
        use rand::seq::SliceRandom;
        let mut ranges: Vec<Option<IpNet>> =
            self.extra.ready_cidrs(ipv6).into_iter().map(Some).collect();
        if self.flag_of_family(ipv6).is_some() {
            // The flag's range, as the default ServiceCIDR `kubernetes`.
            ranges.push(None);
        }
        ranges.shuffle(&mut rand::rng());
        for range in ranges {
            let picked = match range {
                None => self
                    .flag_of_family(ipv6)
                    .expect("checked above")
                    .allocate_next(),
                Some(cidr) => self.allocate_next_in(cidr),
            };
            match picked {
                Ok(ip) => return Ok(ip),
                Err(ip::Error::Full) => continue,
                Err(ip::Error::TooLarge { .. } | ip::Error::NoUsableAddress { .. }) => continue,
                Err(other) => return Err(other),
            }
        }
        Err(ip::Error::Full)
    }

    /// A free address of one added CIDR: its own bitmap (bands as KEP-3070), holding every
    /// address of the CIDR recorded anywhere.
    fn allocate_next_in(&mut self, cidr: IpNet) -> Result<IpAddr, ip::Error> {
        let mut scratch = ip::Allocator::new(cidr)?;
        let taken: Vec<IpAddr> = self
            .extra
            .allocated
            .iter()
            .copied()
            .chain(self.primary.iter())
            .chain(self.secondary.iter().flat_map(|a| a.iter()))
            .filter(|ip| cidr.contains(ip))
            .collect();
        for ip in taken {
            // Addresses the scratch bitmap does not cover (beyond its cap) cannot be picked.
            let _ = scratch.allocate(ip);
        }
        let ip = scratch.allocate_next()?;
        self.record(ip)?;
        Ok(ip)
    }

    /// Gives `ip` back, wherever it is recorded.
    pub fn release(&mut self, ip: IpAddr) {
        match flag_allocator(self.primary, self.secondary.as_deref_mut(), ip) {
            Some(a) => a.release(ip),
            None => {
                self.extra.allocated.remove(&ip);
            }
        }
    }

    /// The allocated addresses inside `cidr` that no other Ready range (the flag's, or another
    /// added ServiceCIDR than `except`) covers: what keeps a ServiceCIDR being deleted.
    pub fn stranded(&mut self, cidr: IpNet, except: &str) -> Vec<IpAddr> {
        let others: Vec<IpNet> = self
            .extra
            .service_cidrs
            .iter()
            .filter(|(name, c)| name.as_str() != except && c.ready)
            .flat_map(|(_, c)| c.cidrs.iter().copied())
            .collect();
        let flag: Vec<IpNet> = std::iter::once(self.primary.cidr())
            .chain(self.secondary.as_ref().map(|a| a.cidr()))
            .collect();
        self.extra
            .allocated
            .iter()
            .copied()
            .chain(self.primary.iter())
            .chain(self.secondary.iter().flat_map(|a| a.iter()))
            .filter(|ip| cidr.contains(ip))
            .filter(|ip| !others.iter().chain(&flag).any(|c| c.contains(ip)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view_parts() -> (ip::Allocator, ExtraRanges) {
        let primary = ip::Allocator::new("10.96.0.0/28".parse().unwrap()).unwrap();
        let mut extra = ExtraRanges::default();
        extra.service_cidrs.insert(
            "more".into(),
            ExtraCidr {
                cidrs: vec!["10.97.0.0/28".parse().unwrap()],
                ready: true,
            },
        );
        (primary, extra)
    }

    #[test]
    fn picks_continue_in_an_added_range_once_the_flags_range_is_full() {
        let (mut primary, mut extra) = view_parts();
        let mut view = View {
            primary: &mut primary,
            secondary: None,
            extra: &mut extra,
        };
        let mut seen = BTreeSet::new();
        for _ in 0..28 {
            let ip = view.allocate_next(false).unwrap();
            assert!(seen.insert(ip), "{ip} twice");
        }
        assert_eq!(view.allocate_next(false), Err(ip::Error::Full));
        assert_eq!(extra.allocated.len(), 14);
        assert_eq!(primary.used(), 14);
    }

    #[test]
    fn an_address_of_an_overlapping_range_is_recorded_once() {
        let (mut primary, mut extra) = view_parts();
        // A wider range that contains the flag's: its picks never repeat a flag address.
        extra.service_cidrs.insert(
            "wide".into(),
            ExtraCidr {
                cidrs: vec!["10.96.0.0/27".parse().unwrap()],
                ready: true,
            },
        );
        let mut view = View {
            primary: &mut primary,
            secondary: None,
            extra: &mut extra,
        };
        view.allocate("10.96.0.5".parse().unwrap()).unwrap();
        assert_eq!(
            view.allocate("10.96.0.5".parse().unwrap()),
            Err(ip::Error::Allocated)
        );
        let mut seen = BTreeSet::from(["10.96.0.5".parse::<IpAddr>().unwrap()]);
        while let Ok(ip) = view.allocate_next(false) {
            assert!(seen.insert(ip), "{ip} twice");
        }
        // /27 and /28 of 10.97: 30 + 14 usable addresses, none twice.
        assert_eq!(seen.len(), 30 + 14);
        // A deleted range takes nothing new but its addresses are released as usual.
        view.extra.service_cidrs.get_mut("more").unwrap().ready = false;
        let ip: IpAddr = "10.97.0.3".parse().unwrap();
        view.release(ip);
        assert_eq!(
            view.allocate(ip),
            Err(ip::Error::NotInRange {
                ip,
                range: "10.96.0.0/28".into()
            })
        );
        assert_eq!(
            view.stranded("10.97.0.0/28".parse().unwrap(), "more").len(),
            13
        );
    }
}
