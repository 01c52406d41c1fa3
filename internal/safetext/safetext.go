// Package safetext makes text from anywhere (error messages that formatted a record's bytes)
// safe to store and send: valid UTF-8, no NUL, bounded in bytes.
package safetext

import (
	"fmt"
	"strings"
	"unicode/utf8"
)

// Text returns s as text that every store of it takes, Postgres and people alike: valid UTF-8
// without NUL bytes, at most n bytes long. Each invalid byte and each NUL is written as a \xNN
// escape (an error message that formatted a binary value stays readable); a longer result is
// shortened as by Truncate. Every message kafkapg stores in Postgres or sends in a header goes through it.
func Text(s string, n int) string {
	if len(s) > n+utf8.UTFMax {
		s = s[:n+utf8.UTFMax] // each byte becomes at least one byte of the result
	}
	if utf8.ValidString(s) && strings.IndexByte(s, 0) < 0 {
		return Truncate(s, n)
	}
	var b strings.Builder
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == 0 || (r == utf8.RuneError && size == 1) {
			fmt.Fprintf(&b, `\x%02x`, s[i])
		} else {
			b.WriteString(s[i : i+size])
		}
		i += size
	}
	return Truncate(b.String(), n)
}

// Truncate shortens s to at most n bytes without splitting a UTF-8 sequence, marking the cut with
// "…" (which counts towards n) when there is room for it.
func Truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	const mark = "…"
	if n < len(mark) {
		return cutAt(s, max(n, 0))
	}
	return cutAt(s, n-len(mark)) + mark
}

// cutAt returns the longest prefix of s of at most n bytes that ends on a rune boundary.
func cutAt(s string, n int) string {
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}
