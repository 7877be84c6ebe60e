//! The crate's one error type. Expected transfer outcomes (a failed completion, an unknown
//! outcome that quarantined a region) are values in [`crate::transfer::TransferOutcome`], not
//! errors; `Err` is for calls that were refused before anything was handed to the NIC.

use gpucache_dataplane::registry::{PoolError, RegionId};

/// Why a NIC call was refused. Nothing was posted, so no buffer was handed to the NIC.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NicError {
    #[error("fault rates add up to {total_per_million} per million, the most is {max_per_million}")]
    FaultRatesTooHigh { total_per_million: u64, max_per_million: u64 },
    #[error("endpoint holds {registered} memory regions, its limit is {max}")]
    RegistrationsFull { registered: usize, max: usize },
    #[error("memory key {key:#x} is not registered on this endpoint")]
    UnknownKey { key: u32 },
    #[error("send queue holds {outstanding} work requests, its depth is {depth}")]
    QueueFull { outstanding: usize, depth: usize },
    #[error("region of {len_bytes} bytes refused, the most is {max_bytes}")]
    RegionTooLarge { len_bytes: u64, max_bytes: u64 },
    #[error("memory key space exhausted after {registered} registrations")]
    KeysExhausted { registered: u64 },
    #[error("region {region} is not lent and usable (quarantined, fenced or returned)")]
    LeaseNotUsable { region: RegionId },
    #[error("transfer of {len_bytes} bytes does not fit a slot of {slot_bytes} bytes")]
    TooLong { len_bytes: u64, slot_bytes: u64 },
    #[error("work request id space exhausted at {at}")]
    RequestIdsExhausted { at: u64 },
    #[error(transparent)]
    Pool(#[from] PoolError),
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpucache_dataplane::registry::RegistryError;

    #[test]
    fn every_variant_displays_its_numbers() {
        let cases = [
            (
                NicError::FaultRatesTooHigh {
                    total_per_million: 1_200_000,
                    max_per_million: 1_000_000,
                },
                "fault rates add up to 1200000 per million, the most is 1000000",
            ),
            (
                NicError::RegistrationsFull { registered: 8, max: 8 },
                "endpoint holds 8 memory regions, its limit is 8",
            ),
            (
                NicError::UnknownKey { key: 0x12 },
                "memory key 0x12 is not registered on this endpoint",
            ),
            (
                NicError::QueueFull { outstanding: 4, depth: 4 },
                "send queue holds 4 work requests, its depth is 4",
            ),
            (
                NicError::RegionTooLarge { len_bytes: 9, max_bytes: 8 },
                "region of 9 bytes refused, the most is 8",
            ),
            (
                NicError::KeysExhausted { registered: 7 },
                "memory key space exhausted after 7 registrations",
            ),
            (
                NicError::LeaseNotUsable { region: RegionId(3) },
                "region r3 is not lent and usable (quarantined, fenced or returned)",
            ),
            (
                NicError::TooLong { len_bytes: 10, slot_bytes: 8 },
                "transfer of 10 bytes does not fit a slot of 8 bytes",
            ),
            (NicError::RequestIdsExhausted { at: 9 }, "work request id space exhausted at 9"),
            (
                NicError::Pool(PoolError::Registry(RegistryError::Unknown(RegionId(5)))),
                "region r5 is not registered",
            ),
        ];
        for (e, want) in cases {
            assert_eq!(e.to_string(), want);
        }
    }
}
