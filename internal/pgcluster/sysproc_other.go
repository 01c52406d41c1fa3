//go:build !linux

package pgcluster

import "syscall"

// sysProcAttr runs a child as cred, in its own process group. Only Linux can have a child
// signalled when its parent dies: elsewhere a server outlives a test process that crashes or is
// killed (Close still stops it), and must be stopped by hand (its dir is pgcluster-* in the temp
// dir: pg_ctl stop -D <dir>/data).
func sysProcAttr(cred *syscall.Credential, _ syscall.Signal) *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Credential: cred, Setpgid: true}
}
