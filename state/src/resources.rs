//! A proxy's resource limits: what its cgroup's `memory.max`, `cpu.max` and `pids.max`
//! say. The agent writes them into the proxy's own cgroup, and again, in place, when they
//! change.

use std::fmt;

/// The limits of one proxy's cgroup; `None` is no limit (`max`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ResourceLimits {
    /// `memory_max`: bytes, at least [`ResourceLimits::MIN_MEMORY`].
    pub memory_max: Option<u64>,
    /// `cpus`: a share of CPU time, in cores.
    pub cpus: Option<CpuLimit>,
    /// `pids_max`: processes and threads, at least 1.
    pub pids_max: Option<u64>,
}

impl ResourceLimits {
    /// The smallest `memory_max`: below it, a proxy is killed for memory before its program
    /// has started.
    pub const MIN_MEMORY: u64 = 1 << 20;

    /// Whether any limit is set.
    pub fn any(&self) -> bool {
        self.memory_max.is_some() || self.cpus.is_some() || self.pids_max.is_some()
    }
}

/// A CPU limit, in thousandths of a core: `cpus = 0.5` is 500, which `cpu.max` writes as
/// 50 ms of CPU time per 100 ms period.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CpuLimit(u32);

impl CpuLimit {
    /// The `cpu.max` period, in microseconds.
    pub const PERIOD_MICROS: u64 = 100_000;
    /// The smallest limit, 0.01 core: the kernel's smallest quota is 1 ms per period.
    pub const MIN_MILLICORES: u32 = 10;
    /// The largest limit, 4096 cores.
    pub const MAX_MILLICORES: u32 = 4096 * 1000;

    /// `cores` (such as `0.5` or `2`), rounded to the thousandth.
    ///
    /// # Errors
    ///
    /// A message naming the accepted range, when `cores` is not a finite number between
    /// 0.01 and 4096.
    pub fn from_cores(cores: f64) -> Result<Self, String> {
        let millicores = (cores * 1000.0).round();
        if !cores.is_finite()
            || millicores < f64::from(Self::MIN_MILLICORES)
            || millicores > f64::from(Self::MAX_MILLICORES)
        {
            return Err(format!("invalid cpus {cores}: expected a number of cores from 0.01 to 4096, such as 0.5"));
        }
        Ok(Self(millicores as u32))
    }

    /// The limit in cores.
    pub fn cores(self) -> f64 {
        f64::from(self.0) / 1000.0
    }

    /// The limit in thousandths of a core.
    pub fn millicores(self) -> u32 {
        self.0
    }

    /// The CPU time allowed per [`CpuLimit::PERIOD_MICROS`], in microseconds.
    pub fn quota_micros(self) -> u64 {
        u64::from(self.0) * Self::PERIOD_MICROS / 1000
    }
}

impl fmt::Display for CpuLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.cores())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpus_round_to_the_thousandth_and_keep_to_the_kernels_range() {
        assert_eq!(CpuLimit::from_cores(0.5).unwrap().quota_micros(), 50_000);
        assert_eq!(CpuLimit::from_cores(2.0).unwrap().quota_micros(), 200_000);
        assert_eq!(CpuLimit::from_cores(0.0104).unwrap().millicores(), 10);
        assert_eq!(CpuLimit::from_cores(0.01).unwrap().quota_micros(), 1_000);
        for bad in [0.0, 0.004, -1.0, 4097.0, f64::NAN, f64::INFINITY] {
            let error = CpuLimit::from_cores(bad).unwrap_err();
            assert!(error.contains("0.01 to 4096"), "{bad}: {error}");
        }
        assert_eq!(CpuLimit::from_cores(0.25).unwrap().to_string(), "0.25");
    }
}
