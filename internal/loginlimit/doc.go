// Package loginlimit slows down password and token guessing on the operator surfaces (the
// console and the operator API): it counts each client address's failed sign-ins and, past a
// burst, refuses that address's attempts (429 with Retry-After) until enough time has passed.
//
// What it guarantees: one address gets at most Burst failed attempts at once, then one every
// Every; a successful sign-in is never counted; memory is bounded (at most MaxClients addresses
// are tracked; past that, untracked addresses share one allowance).
//
// What it does not: tell clients behind one address apart. It keys on the connection's address
// (X-Forwarded-For is not trusted: any client can write it), an IPv6 address by its /64, so
// clients behind one proxy or NAT share an allowance, and an attacker there can lock the others
// out for as long as it keeps failing. It is a brake on guessing, not a defence against a flood
// (the servers' connection limits are).
package loginlimit
