//! Tests of the cgroup subtree on a fake cgroup directory: limits, controllers, names.

use super::*;

#[test]
fn mountinfo_names_the_cgroup2_mounts() {
    let mountinfo = "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n\
                     32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n\
                     41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n";
    assert_eq!(cgroup2_mounts(mountinfo), vec![(PathBuf::from("/sys/fs/cgroup/unified"), "/".to_owned())]);
}

#[test]
fn a_subtree_name_depends_only_on_the_owner() {
    assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
    assert_eq!(fnv1a(b"/var/lib/tether"), fnv1a(b"/var/lib/tether"));
    assert_ne!(fnv1a(b"/var/lib/tether"), fnv1a(b"/var/lib/tether2"));
}

/// A fake cgroup directory: the files the limits are written to.
fn fake(controllers: &[&str]) -> (tempfile::TempDir, Cgroups) {
    let temp = tempfile::tempdir().unwrap();
    let dir = temp.path().join("tether-test");
    fs::create_dir(&dir).unwrap();
    let tree = Tree {
        dir,
        dir_in_hierarchy: "/tether-test".to_owned(),
        controllers: controllers.iter().map(|c| (*c).to_owned()).collect(),
        claimed: Mutex::default(),
        next: AtomicU64::new(1),
        events: OnceLock::new(),
    };
    (temp, Cgroups { tree: Arc::new(tree) })
}

fn limits(memory: Option<u64>, cpus: Option<f64>, pids: Option<u64>) -> ResourceLimits {
    ResourceLimits {
        memory_max: memory,
        cpus: cpus.map(|c| tether_state::CpuLimit::from_cores(c).unwrap()),
        pids_max: pids,
    }
}

#[test]
fn limits_are_written_as_the_kernel_reads_them_and_none_is_max() {
    let (_temp, cgroups) = fake(&["cpu", "memory", "pids"]);
    let dir = cgroups.dir().join("web-proxy@1");
    fs::create_dir(&dir).unwrap();
    cgroups.set_limits("web-proxy@1", &limits(Some(256 << 20), Some(0.5), Some(512))).unwrap();
    let read = |file: &str| fs::read_to_string(dir.join(file)).unwrap();
    assert_eq!(read("memory.max"), "268435456");
    assert_eq!(read("cpu.max"), "50000 100000");
    assert_eq!(read("pids.max"), "512");
    cgroups.set_limits("web-proxy@1", &ResourceLimits::default()).unwrap();
    assert_eq!(read("memory.max"), "max");
    assert_eq!(read("cpu.max"), "max 100000");
    assert_eq!(read("pids.max"), "max");
}

#[test]
fn a_limit_without_its_controller_names_the_controller_and_writes_nothing() {
    let (_temp, cgroups) = fake(&["pids"]);
    let dir = cgroups.dir().join("web-proxy@1");
    fs::create_dir(&dir).unwrap();
    let error = cgroups.set_limits("web-proxy@1", &limits(Some(64 << 20), None, Some(8))).unwrap_err();
    let message = error.to_string();
    assert!(message.starts_with("memory_max needs the cgroup memory controller"), "{message}");
    assert!(message.ends_with("(enabled: pids)"), "{message}");
    assert!(!dir.join("pids.max").exists());
    let error = fake(&[]).1.check_controllers(&limits(None, Some(1.0), None)).unwrap_err();
    assert!(error.to_string().contains("cpus needs the cgroup cpu controller") && error.to_string().contains("none"));
}

#[test]
fn a_new_cgroup_with_a_limit_it_cannot_have_is_not_created() {
    let (_temp, cgroups) = fake(&[]);
    assert!(cgroups.create("web-proxy", &limits(None, None, Some(8))).is_err());
    assert_eq!(fs::read_dir(cgroups.dir()).unwrap().count(), 0);
    assert!(lock(&cgroups.tree.claimed).is_empty());
}
