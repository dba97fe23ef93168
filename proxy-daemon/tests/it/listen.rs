//! Listeners handed to every instance: descriptors from 3, `LISTEN_*`, and the same
//! sockets across restarts, so that connections wait while no instance accepts.

use std::os::unix::fs::MetadataExt;
use std::sync::Arc;

use tether_proxy_daemon::{InheritedSocket, bind_listener};
use tether_state::ListenAddress;

use crate::support::*;

/// What the instance saw, written to its log before it sleeps: its pid, `LISTEN_PID`,
/// `LISTEN_FDS`, `LISTEN_FDNAMES` and the inodes behind descriptors 3 and 4.
const REPORT: &str = r#"echo "$$ $LISTEN_PID $LISTEN_FDS $LISTEN_FDNAMES $(stat -L -c %i /proc/$$/fd/3) $(stat -L -c %i /proc/$$/fd/4)"; exec sleep 3600"#;

fn socket_inode(socket: &InheritedSocket) -> u64 {
    use std::os::fd::AsRawFd;
    std::fs::metadata(format!("/proc/self/fd/{}", socket.socket.as_raw_fd())).unwrap().ino()
}

#[tokio::test]
async fn every_instance_inherits_the_same_listeners_by_socket_activation() {
    let fx = Fixture::new();
    let unix = ListenAddress::Unix(fx.data_dir().join("web.sock"));
    let tcp = ListenAddress::parse("127.0.0.1:0").map(|_| ()).err();
    assert!(tcp.is_some(), "port 0 is refused: listeners have fixed addresses");
    let public = InheritedSocket { name: "public".into(), socket: Arc::new(bind_listener(&unix).unwrap()) };
    let admin_path = ListenAddress::Unix(fx.data_dir().join("admin.sock"));
    let admin = InheritedSocket { name: "admin".into(), socket: Arc::new(bind_listener(&admin_path).unwrap()) };
    let inodes = (socket_inode(&public), socket_inode(&admin));

    let mut spec = fx.spec("web-proxy", &[]);
    spec.program = "/bin/sh".into();
    spec.args = vec!["-c".into(), REPORT.into()];
    spec.listeners = vec![public, admin];
    let stdout = spec.logs.stdout.path();
    let handle = fx.supervisor.spawn(spec).await.unwrap();
    let mut pid = handle.status().figures.pid.unwrap();
    for round in 1..=2 {
        eventually("the instance's report", || {
            std::fs::read_to_string(&stdout).is_ok_and(|log| log.lines().count() == round)
        })
        .await;
        let log = std::fs::read_to_string(&stdout).unwrap();
        let report: Vec<&str> = log.lines().last().unwrap().split(' ').collect();
        assert_eq!(
            report,
            [
                pid.to_string().as_str(),
                pid.to_string().as_str(),
                "2",
                "public:admin",
                inodes.0.to_string().as_str(),
                inodes.1.to_string().as_str()
            ],
            "round {round}: pid, LISTEN_PID, LISTEN_FDS, LISTEN_FDNAMES, the inodes of 3 and 4"
        );
        // While no instance accepts, a connection waits in the backlog instead of being
        // refused.
        send(pid, nix::sys::signal::Signal::SIGKILL);
        std::os::unix::net::UnixStream::connect(fx.data_dir().join("web.sock")).expect("not refused");
        pid = restarted(&handle, pid).await;
    }
    within("stop", handle.stop()).await;
}
