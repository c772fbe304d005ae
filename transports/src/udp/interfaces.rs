//! The host's network interfaces: turning `RANKWEAVE_ROUTES` entries (addresses, interface
//! names, subnets) into the local addresses routes bind to.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use rankweave_core::{RouteSpec, TransportError};

/// One address of one interface.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InterfaceAddr {
    /// The interface's name (`eth0`).
    pub name: String,
    /// The address.
    pub addr: IpAddr,
    /// The interface is up.
    pub up: bool,
    /// It is a loopback interface.
    pub loopback: bool,
}

/// Every IPv4 and IPv6 address of every interface, in the kernel's order.
pub fn interface_addrs() -> Result<Vec<InterfaceAddr>, TransportError> {
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs stores a list it allocated in `list` (freed below with freeifaddrs);
    // we pass a valid pointer to a local.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return Err(TransportError::Io {
            op: "list network interfaces",
            message: std::io::Error::last_os_error().to_string(),
        });
    }
    let mut out = Vec::new();
    let mut cur = list;
    while !cur.is_null() {
        // SAFETY: `cur` is a non-null node of the list getifaddrs returned, not yet freed.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: `ifa_addr` is non-null and points into the list; every sockaddr starts with
        // its family.
        let family = i32::from(unsafe { (*ifa.ifa_addr).sa_family });
        let addr = match family {
            libc::AF_INET => {
                // SAFETY: the family says this is a `sockaddr_in`.
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)))
            }
            libc::AF_INET6 => {
                // SAFETY: the family says this is a `sockaddr_in6`.
                let sin6 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
                IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr))
            }
            _ => continue,
        };
        // SAFETY: `ifa_name` is a non-null NUL-terminated string owned by the list.
        let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }
            .to_string_lossy()
            .into_owned();
        out.push(InterfaceAddr {
            name,
            addr,
            up: ifa.ifa_flags & (libc::IFF_UP as u32) != 0,
            loopback: ifa.ifa_flags & (libc::IFF_LOOPBACK as u32) != 0,
        });
    }
    // SAFETY: `list` came from a successful getifaddrs and is freed exactly once.
    unsafe { libc::freeifaddrs(list) };
    Ok(out)
}

/// The local address a route entry names: the address itself, the interface's first IPv4
/// (else IPv6) address, or the local address inside the subnet.
pub fn resolve(spec: &RouteSpec) -> Result<IpAddr, TransportError> {
    if let RouteSpec::Addr(ip) = spec {
        return Ok(*ip);
    }
    let addrs = interface_addrs()?;
    let found = match spec {
        RouteSpec::Addr(_) => None,
        RouteSpec::Interface(name) => {
            let mine = || addrs.iter().filter(|a| &a.name == name);
            mine()
                .find(|a| a.addr.is_ipv4())
                .or_else(|| mine().next())
                .map(|a| a.addr)
        }
        RouteSpec::Subnet(..) => addrs
            .iter()
            .find(|a| a.up && spec.contains(a.addr))
            .map(|a| a.addr),
    };
    found.ok_or_else(|| TransportError::Io {
        op: "resolve RANKWEAVE_ROUTES",
        message: format!(
            "no local address for route {spec} (interfaces: {})",
            describe(&addrs)
        ),
    })
}

/// The first IPv4 address of an interface that is up and not loopback: the default route of a
/// job whose ranks are on several hosts.
pub fn first_external_ipv4() -> Option<Ipv4Addr> {
    interface_addrs()
        .ok()?
        .into_iter()
        .find_map(|a| match a.addr {
            IpAddr::V4(v4) if a.up && !a.loopback => Some(v4),
            _ => None,
        })
}

fn describe(addrs: &[InterfaceAddr]) -> String {
    addrs
        .iter()
        .map(|a| format!("{} {}", a.name, a.addr))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_resolves_by_name_and_subnet() {
        let lo = IpAddr::from([127, 0, 0, 1]);
        assert_eq!(resolve(&RouteSpec::Interface("lo".into())).unwrap(), lo);
        assert_eq!(
            resolve(&RouteSpec::Subnet(IpAddr::from([127, 0, 0, 0]), 8)).unwrap(),
            lo
        );
        assert_eq!(resolve(&RouteSpec::Addr(lo)).unwrap(), lo);
        let e = resolve(&RouteSpec::Interface("nosuchif0".into())).unwrap_err();
        assert!(e.to_string().contains("nosuchif0"), "{e}");
        assert!(e.to_string().contains("lo 127.0.0.1"), "{e}");
        let e = resolve(&RouteSpec::Subnet(IpAddr::from([240, 1, 2, 0]), 24)).unwrap_err();
        assert!(e.to_string().contains("240.1.2.0/24"), "{e}");
        assert!(
            interface_addrs()
                .unwrap()
                .iter()
                .any(|a| a.loopback && a.addr == lo)
        );
    }
}
