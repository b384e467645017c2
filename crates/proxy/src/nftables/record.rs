//! The applier's record of one table, kept small: who owns which elements ([`Claims`]) and
//! what was applied for each owner ([`Units`]).
//!
//! At 100,000 Services × 10 endpoints the record holds 1.3 million claims (a destination, a
//! NodePort, or an address: ten hairpin addresses per port), so its layout is most of what
//! the applier keeps per Service port. An owner is named in every claim by a 4-byte
//! [`OwnerId`], an index into [`Units`], rather than by its name; a claim of an IPv4 address
//! or of a NodePort is stored in 8 bytes. One claim costs 12 bytes plus the hash table's
//! room, where a claim keyed by an `IpAddr` with a shared pointer to its owner's name cost 40
//! (docs/BENCHMARKS.md, "kept state").

use std::cmp::Ordering;
use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap};
use std::hash::BuildHasher;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

use hashbrown::HashTable;

use super::apply::AppliedChains;
use super::flat::SetBounds;
use crate::desired::ServicePortState;
use crate::model::{IpFamily, Protocol, ServicePortName};

/// A hash map with a fast, seeded hash: the record holds an entry per claim (a million and
/// more at 100,000 Services), where SipHash cost a tenth of a full sync's user time.
pub(super) type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// The unit of ownership of elements. Every element belongs to one claim: everything keyed by
/// one destination (`addr . proto . port`, with or without an endpoint slot or a source
/// range), everything keyed by one NodePort, or one address (or address pair) of one set.
/// When several owners render elements of one claim (two Services with the same external IP
/// and port, the ports of a Service sharing their ClusterIP in `cluster-ips`, endpoints shared
/// by Services in `hairpin-ips`), the first owner's elements of that claim are the ones in
/// the kernel, all of them and only them: a destination is never served by a mix of two
/// Services' endpoint slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(super) enum Claim {
    /// A destination.
    Dst(IpAddr, Protocol, u16),
    /// A NodePort.
    NodePort(Protocol, u16),
    /// An address (the first of a pair) in the set of that index in the applier's
    /// `CLAIM_SETS`.
    Addr(u8, IpAddr),
}

/// A [`Claim`] without an IPv6 address, in 8 bytes (a `Claim` is 22).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Claim4 {
    Dst(Ipv4Addr, Protocol, u16),
    NodePort(Protocol, u16),
    Addr(u8, Ipv4Addr),
}

impl Claim {
    fn compact(&self) -> Option<Claim4> {
        Some(match *self {
            Claim::Dst(IpAddr::V4(ip), proto, port) => Claim4::Dst(ip, proto, port),
            Claim::NodePort(proto, port) => Claim4::NodePort(proto, port),
            Claim::Addr(set, IpAddr::V4(ip)) => Claim4::Addr(set, ip),
            _ => return None,
        })
    }
}

/// An owner of elements in one table's record: the static objects ([`OwnerId::BASE`]) or a
/// Service port; an index into [`Units`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct OwnerId(u32);

impl OwnerId {
    /// The static objects (chains, shared sets, the node's addresses).
    pub(super) const BASE: OwnerId = OwnerId(0);

    fn index(self) -> usize {
        self.0 as usize
    }
}

/// The first owner of a claim, with [`MORE`] set when it has others (listed in
/// [`Claims::shared`]).
#[derive(Debug, Clone, Copy)]
struct First(u32);

/// [`First`]'s flag: the claim has several owners.
const MORE: u32 = 1 << 31;

impl First {
    fn owner(self) -> OwnerId {
        OwnerId(self.0 & !MORE)
    }

    fn shared(self) -> bool {
        self.0 & MORE != 0
    }
}

/// The owners of every claim of one table. Nearly every claim has one owner, stored beside
/// the claim; the others' full lists are kept apart.
#[derive(Debug, Clone, Default)]
pub(super) struct Claims {
    /// Claims of IPv4 addresses and of NodePorts.
    compact: FastMap<Claim4, First>,
    /// Claims of IPv6 addresses.
    wide: FastMap<Claim, First>,
    /// Every owner, in order, of the claims that have several.
    shared: FastMap<Claim, Box<[OwnerId]>>,
}

impl Claims {
    /// Makes room for `n` claims of a `family` table at once (growing would rehash a million
    /// entries in steps).
    pub(super) fn reserve(&mut self, family: IpFamily, n: usize) {
        match family {
            IpFamily::V4 => self.compact.reserve(n),
            IpFamily::V6 => self.wide.reserve(n),
        }
    }

    fn get(&self, claim: &Claim) -> Option<First> {
        match claim.compact() {
            Some(c) => self.compact.get(&c).copied(),
            None => self.wide.get(claim).copied(),
        }
    }

    fn set(&mut self, claim: Claim, first: Option<First>) {
        match (claim.compact(), first) {
            (Some(c), Some(f)) => {
                self.compact.insert(c, f);
            }
            (Some(c), None) => {
                self.compact.remove(&c);
            }
            (None, Some(f)) => {
                self.wide.insert(claim, f);
            }
            (None, None) => {
                self.wide.remove(&claim);
            }
        }
    }

    /// The owner whose elements of `claim` are in the kernel.
    pub(super) fn first(&self, claim: &Claim) -> Option<OwnerId> {
        self.get(claim).map(First::owner)
    }

    /// Adds `owner` to the owners of `claim` in its place by `order` (nothing if it is one);
    /// returns whether it is the first.
    pub(super) fn add(
        &mut self,
        claim: Claim,
        owner: OwnerId,
        order: impl Fn(OwnerId, OwnerId) -> Ordering,
    ) -> bool {
        assert!(owner.0 < MORE, "owner ids stay below 2^31");
        // A new claim (nearly every claim of a full sync) costs one lookup.
        let first = match claim.compact() {
            Some(c) => match self.compact.entry(c) {
                Entry::Vacant(v) => {
                    v.insert(First(owner.0));
                    return true;
                }
                Entry::Occupied(o) => *o.get(),
            },
            None => match self.wide.entry(claim) {
                Entry::Vacant(v) => {
                    v.insert(First(owner.0));
                    return true;
                }
                Entry::Occupied(o) => *o.get(),
            },
        };
        let mut list: Vec<OwnerId> = match first.shared() {
            true => self.shared.get(&claim).expect("listed").to_vec(),
            false => vec![first.owner()],
        };
        if let Err(i) = list.binary_search_by(|o| order(*o, owner)) {
            list.insert(i, owner);
        }
        if list.len() > 1 {
            self.set(claim, Some(First(list[0].0 | MORE)));
            let won = list[0] == owner;
            self.shared.insert(claim, list.into_boxed_slice());
            won
        } else {
            list[0] == owner
        }
    }

    /// Removes `owner` from the owners of `claim` (nothing if it is not one).
    pub(super) fn remove(&mut self, claim: &Claim, owner: OwnerId) {
        let Some(first) = self.get(claim) else {
            return;
        };
        if !first.shared() {
            if first.owner() == owner {
                self.set(*claim, None);
            }
            return;
        }
        let list = self.shared.get_mut(claim).expect("listed");
        let rest: Vec<OwnerId> = list.iter().copied().filter(|o| *o != owner).collect();
        let first = match rest.as_slice() {
            [one] => {
                self.shared.remove(claim);
                First(one.0)
            }
            _ => {
                let first = First(rest[0].0 | MORE);
                *list = rest.into_boxed_slice();
                first
            }
        };
        self.set(*claim, Some(first));
    }

    /// Number of claims.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.compact.len() + self.wide.len()
    }
}

/// What was applied for one owner.
#[derive(Debug, Clone, Default)]
pub(super) struct Unit {
    /// The Service port's state the owner's elements were rendered from (`None` for the
    /// static objects, whose elements the table keeps, and for a free slot). The record keeps
    /// no element of a Service port: it renders them again from this when it needs them (a
    /// partial sync, to know what to delete). Shared with the desired state while the port
    /// is unchanged, so it costs a pointer.
    pub(super) source: Option<Arc<ServicePortState>>,
    /// Chains and sets, for the owners that have any: the static objects, and the Service
    /// ports of kube-proxy's layout (in the flat layout, IPv6 ports with affinity).
    objects: Option<Box<UnitObjects>>,
}

/// An owner's chains and sets as applied.
#[derive(Debug, Clone, Default)]
struct UnitObjects {
    chains: AppliedChains,
    sets: BTreeMap<String, u64>,
}

static NO_CHAINS: AppliedChains = AppliedChains::EMPTY;
static NO_SETS: BTreeMap<String, u64> = BTreeMap::new();

impl Unit {
    /// A Service port's unit, before anything was applied for it.
    pub(super) fn of(source: Arc<ServicePortState>) -> Self {
        Unit {
            source: Some(source),
            objects: None,
        }
    }

    /// The Service port's name (`None`: the static objects).
    pub(super) fn name(&self) -> Option<&ServicePortName> {
        self.source.as_deref().map(ServicePortState::name)
    }

    /// The chains, each with the hash of its hook and rules.
    pub(super) fn chains(&self) -> &AppliedChains {
        self.objects.as_deref().map_or(&NO_CHAINS, |o| &o.chains)
    }

    /// Set name → content hash of its spec.
    pub(super) fn sets(&self) -> &BTreeMap<String, u64> {
        self.objects.as_deref().map_or(&NO_SETS, |o| &o.sets)
    }

    /// Takes what was applied besides the elements (to be set again).
    pub(super) fn take_objects(&mut self) -> (AppliedChains, BTreeMap<String, u64>) {
        self.objects
            .take()
            .map(|o| (o.chains, o.sets))
            .unwrap_or_default()
    }

    /// Sets what was applied besides the elements.
    pub(super) fn set_objects(&mut self, chains: AppliedChains, sets: BTreeMap<String, u64>) {
        self.objects = (!chains.is_empty() || !sets.is_empty())
            .then(|| Box::new(UnitObjects { chains, sets }));
    }

    /// What the owner may put into the flat layout's sets.
    pub(super) fn bounds(&self) -> SetBounds {
        self.source
            .as_deref()
            .map(SetBounds::of_port)
            .unwrap_or_default()
    }
}

/// The owners of one table by [`OwnerId`], found by name through a table of ids (hashed by
/// the name their unit holds: 4 bytes an owner rather than a copy of the name).
#[derive(Debug, Clone)]
pub(super) struct Units {
    /// Slot 0 is the static objects; a free slot has no source.
    slots: Vec<Unit>,
    /// Slots of owners gone, to be reused once the sync that freed them is over.
    free: Vec<OwnerId>,
    /// Freed by the sync under way (their ids may still be in the claims it is settling).
    freed: Vec<OwnerId>,
    by_name: HashTable<OwnerId>,
    hasher: foldhash::fast::RandomState,
}

impl Default for Units {
    fn default() -> Self {
        Units {
            slots: vec![Unit::default()],
            free: Vec::new(),
            freed: Vec::new(),
            by_name: HashTable::new(),
            hasher: Default::default(),
        }
    }
}

impl Units {
    /// Makes room for `n` more Service ports.
    pub(super) fn reserve(&mut self, n: usize) {
        self.slots.reserve(n);
        let (slots, hasher) = (&self.slots, &self.hasher);
        self.by_name.reserve(n, |id| {
            hasher.hash_one(slots[id.index()].name().expect("a named slot"))
        });
    }

    /// The unit of `id` (a free slot: an empty one).
    pub(super) fn get(&self, id: OwnerId) -> &Unit {
        &self.slots[id.index()]
    }

    /// The unit of `id`, to update (its name stays).
    pub(super) fn get_mut(&mut self, id: OwnerId) -> &mut Unit {
        &mut self.slots[id.index()]
    }

    /// The owner of Service port `name`.
    pub(super) fn id_of(&self, name: &ServicePortName) -> Option<OwnerId> {
        let slots = &self.slots;
        self.by_name
            .find(self.hasher.hash_one(name), |id| {
                slots[id.index()].name() == Some(name)
            })
            .copied()
    }

    /// The unit of Service port `name`.
    pub(super) fn of(&self, name: &ServicePortName) -> Option<&Unit> {
        self.id_of(name).map(|id| self.get(id))
    }

    /// Adds the owner of a Service port (`unit` has its source, hence its name).
    pub(super) fn add(&mut self, unit: Unit) -> OwnerId {
        let name = unit.name().expect("a Service port's unit").clone();
        debug_assert!(self.id_of(&name).is_none(), "{name} added twice");
        let id = match self.free.pop() {
            Some(id) => {
                self.slots[id.index()] = unit;
                id
            }
            None => {
                self.slots.push(unit);
                OwnerId(u32::try_from(self.slots.len() - 1).expect("fewer than 2^32 owners"))
            }
        };
        let (slots, hasher) = (&self.slots, &self.hasher);
        self.by_name
            .insert_unique(hasher.hash_one(&name), id, |id| {
                hasher.hash_one(slots[id.index()].name().expect("a named slot"))
            });
        id
    }

    /// Removes a Service port's owner; returns its unit. Its id is reused only after
    /// [`Units::settled`].
    pub(super) fn remove(&mut self, id: OwnerId) -> Unit {
        assert_ne!(id, OwnerId::BASE, "the static objects stay");
        let unit = std::mem::take(&mut self.slots[id.index()]);
        let name = unit.name().expect("a Service port's unit");
        if let Ok(entry) = self
            .by_name
            .find_entry(self.hasher.hash_one(name), |o| *o == id)
        {
            entry.remove();
        }
        self.freed.push(id);
        unit
    }

    /// The sync that removed owners is over: their ids may be reused.
    pub(super) fn settled(&mut self) {
        self.free.append(&mut self.freed);
    }

    /// The order of owners: the static objects first, then Service ports by name. Of two
    /// owners claiming one thing, the first one's elements are in the kernel, in a full sync
    /// (which goes in this order) as in a partial one.
    pub(super) fn order(&self, a: OwnerId, b: OwnerId) -> Ordering {
        match (self.get(a).name(), self.get(b).name()) {
            _ if a == b => Ordering::Equal,
            _ if a == OwnerId::BASE => Ordering::Less,
            _ if b == OwnerId::BASE => Ordering::Greater,
            (Some(x), Some(y)) => x.cmp(y),
            // Not reached: an owner leaves every claim before its slot is freed.
            _ => a.0.cmp(&b.0),
        }
    }

    /// Every owner with its unit: the static objects, then the Service ports.
    pub(super) fn iter(&self) -> impl Iterator<Item = (OwnerId, &Unit)> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(i, u)| *i == 0 || u.source.is_some())
            .map(|(i, u)| (OwnerId(i as u32), u))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claims_of(ids: &[u32]) -> (Claims, Claim) {
        let claim = Claim::Addr(2, "10.0.0.1".parse().unwrap());
        let mut c = Claims::default();
        for id in ids {
            c.add(claim, OwnerId(*id), |a, b| a.0.cmp(&b.0));
        }
        (c, claim)
    }

    #[test]
    fn the_first_owner_in_order_holds_a_claim_whatever_the_order_of_arrival() {
        let (mut c, claim) = claims_of(&[5, 3, 9, 3]);
        assert_eq!(c.first(&claim), Some(OwnerId(3)));
        assert_eq!(c.shared[&claim].as_ref(), [3, 5, 9].map(OwnerId));
        c.remove(&claim, OwnerId(3));
        assert_eq!(c.first(&claim), Some(OwnerId(5)));
        c.remove(&claim, OwnerId(7));
        c.remove(&claim, OwnerId(9));
        assert_eq!(c.first(&claim), Some(OwnerId(5)));
        assert!(c.shared.is_empty(), "one owner left: no list");
        c.remove(&claim, OwnerId(5));
        assert_eq!(c.first(&claim), None);
        assert_eq!(c.len(), 0);
    }

    #[test]
    fn claims_of_ipv4_addresses_and_nodeports_are_kept_in_eight_bytes_and_ipv6_ones_apart() {
        assert_eq!(std::mem::size_of::<Claim4>(), 8);
        assert_eq!(std::mem::size_of::<(Claim4, First)>(), 12);
        let mut c = Claims::default();
        let v6 = Claim::Dst("fd00::1".parse().unwrap(), Protocol::Tcp, 80);
        let v4 = Claim::Dst("10.96.0.1".parse().unwrap(), Protocol::Tcp, 80);
        let np = Claim::NodePort(Protocol::Udp, 30001);
        for claim in [v6, v4, np] {
            assert!(c.add(claim, OwnerId(1), |a, b| a.0.cmp(&b.0)));
        }
        assert_eq!((c.compact.len(), c.wide.len()), (2, 1));
        assert_eq!(c.first(&v6), Some(OwnerId(1)));
        assert_eq!(c.first(&Claim::NodePort(Protocol::Tcp, 30001)), None);
    }
}
