package pgcluster

import "syscall"

// sysProcAttr runs a child as cred, in its own process group, sent deathSig when this process
// dies.
func sysProcAttr(cred *syscall.Credential, deathSig syscall.Signal) *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Credential: cred, Setpgid: true, Pdeathsig: deathSig}
}
