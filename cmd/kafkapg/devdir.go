package main

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
)

// Where the dev loop keeps things, and why no other local user can reach or replace them.
//
// Everything lives in <dir> (-dir, .kafkapg by default): the broker's data (kafka/, 0700), the
// Postgres and broker passwords (postgres-password, kafka-password, 0600), the env file (env,
// 0600, it holds both passwords) and Postgres's data (postgres/, 0700, owned by the user
// Postgres runs as). secureDir checks <dir> and each of its parents before anything is
// written: none may be replaced by another user, so no path under <dir> can be swapped for a
// symlink after the check.
//
// As root, Postgres runs as the postgres user, who may not be able to enter <dir> (a home dir
// of mode 0700, t.TempDir()). Its data then goes to devDataBase/<16 hex of sha256(<dir>)>/
// postgres: a root-owned dir that only root writes, so a predictable name there is safe, and
// the data is kept between runs as it would be in <dir>. An older kafkapg dev used
// /tmp/kafkapg-dev-<hash> instead, where any user could plant a symlink first; that is never
// used now. Making the user's dir traversable instead would change the modes of dirs that are
// not the dev loop's.

// devDataBase is the root-owned dir that holds Postgres's data as root when the postgres user
// cannot enter <dir>. A variable for the tests.
var devDataBase = "/var/lib/kafkapg-dev"

// devPostgresDir returns where Postgres's data goes for the dev dir abs: abs/postgres if the
// server's user can enter it, else (as root) a dir under devDataBase, made safely.
func devPostgresDir(abs string, reachable func(string) error, stderr io.Writer) (string, error) {
	pgDir := filepath.Join(abs, "postgres")
	why := reachable(pgDir)
	if why == nil {
		return pgDir, nil
	}
	sum := sha256.Sum256([]byte(abs))
	if old := filepath.Join(os.TempDir(), "kafkapg-dev-"+hex.EncodeToString(sum[:6])); exists(old) {
		fmt.Fprintf(stderr, "kafkapg dev: %s, where an older kafkapg dev kept Postgres's data, is not used any more "+
			"(any user can create a name in %s first): remove it\n", old, os.TempDir())
	}
	parent := filepath.Join(devDataBase, hex.EncodeToString(sum[:8]))
	if err := secureDir(parent, 0o755); err != nil {
		return "", err
	}
	alt := filepath.Join(parent, "postgres")
	if err := reachable(alt); err != nil {
		return "", fmt.Errorf("Postgres's data: neither %s (%v) nor %s will do: %w", pgDir, why, alt, err)
	}
	fmt.Fprintf(stderr, "kafkapg dev: Postgres's data goes to %s instead of %s (%v)\n", alt, pgDir, why)
	return alt, nil
}

// exists reports whether path names anything, a dangling symlink included.
func exists(path string) bool {
	_, err := os.Lstat(path)
	return err == nil
}

// secureDir makes dir (absolute), and any parent missing, and checks what it finds, so that no
// other user can replace dir or anything under it afterwards:
//   - each parent: a directory owned by root or by this process's user, writable by no one
//     else unless sticky (as /tmp: there only an entry's owner can rename or remove it); a
//     symlink owned by root or by us is followed, and its target checked in the same way;
//   - dir itself: a directory, not a symlink, owned by this process's user, writable by no one
//     else. If it exists with more permissions than perm, it gets perm.
//
// Its errors name the path and what is wrong with it.
func secureDir(dir string, perm os.FileMode) error {
	return secureDirDepth(dir, perm, 0)
}

func secureDirDepth(dir string, perm os.FileMode, depth int) error {
	if !filepath.IsAbs(dir) {
		return fmt.Errorf("%s is not an absolute path", dir)
	}
	if depth > 40 {
		return fmt.Errorf("%s: too many levels of symlinks", dir)
	}
	dir = filepath.Clean(dir)
	euid := os.Geteuid()
	var elems []string
	for d := dir; ; d = filepath.Dir(d) {
		elems = append(elems, d)
		if d == filepath.Dir(d) {
			break
		}
	}
	slices.Reverse(elems)
	for i, d := range elems {
		last := i == len(elems)-1
		fi, err := os.Lstat(d)
		if errors.Is(err, fs.ErrNotExist) {
			mode := os.FileMode(0o755)
			if last {
				mode = perm
			}
			// Mkdir does not follow a symlink at d: one planted since the Lstat fails it with
			// EEXIST, and the Lstat below sees it.
			if err := os.Mkdir(d, mode); err != nil && !errors.Is(err, fs.ErrExist) {
				return err
			}
			fi, err = os.Lstat(d)
		}
		if err != nil {
			return err
		}
		if fi.Mode()&os.ModeSymlink != 0 {
			if last {
				return fmt.Errorf("%s is a symlink: refusing to follow it (remove it, or give the dir it points to)", d)
			}
			if uid := ownerOf(fi); uid != 0 && uid != euid {
				return fmt.Errorf("%s is a symlink owned by uid %d, neither root nor you: refusing to follow it", d, uid)
			}
			target, err := filepath.EvalSymlinks(d)
			if err != nil {
				return err
			}
			rest, err := filepath.Rel(d, dir)
			if err != nil {
				return err
			}
			return secureDirDepth(filepath.Join(target, rest), perm, depth+1)
		}
		if !fi.IsDir() {
			return fmt.Errorf("%s is not a directory", d)
		}
		uid, mode := ownerOf(fi), fi.Mode()
		if last {
			if uid != euid {
				return fmt.Errorf("%s is owned by uid %d, not by you (uid %d): refusing to use it (remove it, or give another -dir)", d, uid, euid)
			}
			if mode.Perm()&0o022 != 0 {
				return fmt.Errorf("%s is writable by others (mode %v): refusing to use it (chmod go-w %s)", d, mode.Perm(), d)
			}
			if mode.Perm()&^perm != 0 {
				return os.Chmod(d, mode.Perm()&perm)
			}
			return nil
		}
		if uid != 0 && uid != euid {
			return fmt.Errorf("%s is owned by uid %d, neither root nor you: its owner could replace what is under it; give a -dir elsewhere", d, uid)
		}
		if mode.Perm()&0o022 != 0 && mode&os.ModeSticky == 0 {
			return fmt.Errorf("%s is writable by others (mode %v) and not sticky: another user could replace what is under it; give a -dir elsewhere", d, mode.Perm())
		}
	}
	return nil
}

// ownerOf is the uid that owns a file.
func ownerOf(fi os.FileInfo) int {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return int(st.Uid)
	}
	return -1
}

// checkPrivateFile refuses f, opened from path, unless it is a regular file of this process's
// user that no one else may read or write.
func checkPrivateFile(f *os.File, path string) error {
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	switch {
	case !fi.Mode().IsRegular():
		return fmt.Errorf("%s is not a regular file", path)
	case ownerOf(fi) != os.Geteuid():
		return fmt.Errorf("%s is owned by uid %d, not by you (uid %d)", path, ownerOf(fi), os.Geteuid())
	case fi.Mode().Perm()&0o077 != 0:
		return fmt.Errorf("%s may be read by others (mode %v)", path, fi.Mode().Perm())
	}
	return nil
}

// devPassword returns the password of one of the dev loop's servers (what: "the Postgres
// password", "the broker's password"), kept in path (mode 0600): read, or on first use
// generated (128 random bits) and written, so that it stays the same from one run to the next
// as the data does. A file that another user could have read, or that is not ours, is
// refused: remove it and a new password is generated, which the next start sets on the server
// (pgcluster.Options.Password; the broker's is given to it at each start).
func devPassword(path, what string) (string, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	if errors.Is(err, fs.ErrNotExist) {
		pw := rand.Text()
		f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, 0o600)
		if err != nil {
			return "", fmt.Errorf("%s: %w", what, err)
		}
		_, err = f.WriteString(pw + "\n")
		if err = errors.Join(err, f.Close()); err != nil {
			os.Remove(path)
			return "", fmt.Errorf("%s: %w", what, err)
		}
		return pw, nil
	}
	if errors.Is(err, syscall.ELOOP) {
		return "", fmt.Errorf("%s is a symlink: refusing to follow it (remove it: a new password is generated)", path)
	}
	if err != nil {
		return "", fmt.Errorf("%s: %w", what, err)
	}
	defer f.Close()
	if err := checkPrivateFile(f, path); err != nil {
		return "", fmt.Errorf("%w: refusing %s in it (remove it: a new password is generated)", err, what)
	}
	b, err := io.ReadAll(io.LimitReader(f, 1024))
	if err != nil {
		return "", fmt.Errorf("%s: %w", what, err)
	}
	pw := strings.TrimSpace(string(b))
	if pw == "" || strings.ContainsAny(pw, "\n\r\x00") {
		return "", fmt.Errorf("%s does not hold a password on one line (remove it: a new password is generated)", path)
	}
	return pw, nil
}

// tightenEnv makes an env file an older kafkapg dev left readable by others (mode 0644)
// private to its owner. A symlink there is left alone: writeEnv replaces it.
func tightenEnv(path string) error {
	fi, err := os.Lstat(path)
	if err != nil || !fi.Mode().IsRegular() || fi.Mode().Perm()&0o077 == 0 {
		return nil
	}
	return os.Chmod(path, 0o600)
}
