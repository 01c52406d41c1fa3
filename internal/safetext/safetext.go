// Package safetext makes text from anywhere (error messages that formatted a record's bytes)
// safe to store and send: valid UTF-8, no NUL, bounded in bytes.
package safetext

import (
	"fmt"
	"io"
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

// A terminal takes some bytes and characters as commands, not text: the C0 controls (ESC starts
// its escape sequences: a new window title, a cleared screen, colours), DEL, the C1 controls
// (U+0080–U+009F; U+009B is a CSI of its own), bytes that are not UTF-8, and the bidirectional
// formatting characters, which reorder what is shown around them. TerminalWriter and JSONWriter
// keep them from reaching a person, whatever the bytes kafkapg prints came from.

// control reports whether r is one of them. Tab and newline are not: kafkapg's own output uses
// them (what came from outside is put on one line before it is printed).
func control(r rune) bool {
	switch {
	case r == '\t' || r == '\n':
		return false
	case r < 0x20, r == 0x7f, r >= 0x80 && r <= 0x9f:
		return true
	case r >= 0x202a && r <= 0x202e, r >= 0x2066 && r <= 0x2069, r == 0x200e, r == 0x200f, r == 0x061c:
		return true
	}
	return false
}

// TerminalWriter returns a writer to w, a terminal, that writes each control character (see
// control) and each byte that is not UTF-8 as a visible escape: \x1b, \u202e. UTF-8 sequences
// may be split across writes.
func TerminalWriter(w io.Writer) io.Writer {
	return &escaper{w: w, control: control, escape: visible}
}

// visible writes r (or raw, a byte that is not UTF-8) as an escape a person reads: \x1b, \u202e.
func visible(b *strings.Builder, r rune, raw byte, invalid bool) {
	switch {
	case invalid:
		fmt.Fprintf(b, `\x%02x`, raw)
	case r < 0x100:
		fmt.Fprintf(b, `\x%02x`, r)
	default:
		fmt.Fprintf(b, `\u%04x`, r)
	}
}

// HTML returns a page html/template rendered (or text a browser shows) with what html/template
// leaves as it is made harmless: the controls (see control; carriage returns are kept, HTML
// keeps them harmless) and the bytes that are not UTF-8. A browser obeys the bidirectional ones
// (U+202E shows "exe.txt" as "txt.exe") and hides the rest (ESC, BEL). In text each is written as
// a visible escape (\u202e, \x1b), ASCII that means nothing to HTML; inside a tag (an attribute's
// value: a form's hidden filter) as a character reference (&#x202e;), which is no control in the
// page's bytes and gives the form back the exact value (a byte that is not UTF-8 becomes U+FFFD,
// which a form sends as it is). An attribute a person reads (a title) should hold visible
// escapes already (Visible). The page's own text has no control characters, so only what came
// from outside is changed.
func HTML(page string) string {
	var b strings.Builder
	inTag := false
	for i := 0; i < len(page); {
		r, size := utf8.DecodeRuneInString(page[i:])
		invalid := r == utf8.RuneError && size <= 1
		switch {
		case invalid && inTag:
			b.WriteString("&#xfffd;")
		case (invalid || r != '\r' && control(r)) && inTag:
			fmt.Fprintf(&b, "&#x%x;", r)
		case invalid || r != '\r' && control(r):
			visible(&b, r, page[i], invalid)
		default:
			// html/template writes '<' and '>' of what came from outside as &lt; and &gt;: a
			// raw one is the page's markup.
			switch r {
			case '<':
				inTag = true
			case '>':
				inTag = false
			}
			b.WriteString(page[i : i+size])
		}
		i += max(size, 1)
	}
	return b.String()
}

// Visible returns s with each control character (see control) and each byte that is not UTF-8
// written as a visible escape (\x1b, \u202e), as TerminalWriter writes them.
func Visible(s string) string {
	var b strings.Builder
	e := TerminalWriter(&b).(*escaper)
	io.WriteString(e, s)
	e.flush()
	return b.String()
}

// JSONWriter returns a writer to w for JSON (encoding/json's output: the C0 controls are escaped
// there already) that writes the C1 and bidirectional controls as JSON escapes (\u009b), which
// are valid only inside strings, where JSON has them. Bytes that are not UTF-8 are written as
// U+FFFD, as encoding/json writes them itself.
func JSONWriter(w io.Writer) io.Writer {
	return &escaper{w: w, control: control, escape: func(b *strings.Builder, r rune, _ byte, invalid bool) {
		if invalid {
			r = utf8.RuneError
		}
		fmt.Fprintf(b, `\u%04x`, r)
	}}
}

// escaper writes what it is given to w, with escape's rendering of the controls.
type escaper struct {
	w       io.Writer
	control func(r rune) bool // what is escaped
	escape  func(b *strings.Builder, r rune, raw byte, invalid bool)
	pending []byte // the start of a UTF-8 sequence the last write ended in
}

func (e *escaper) Write(p []byte) (int, error) {
	in := p
	if len(e.pending) > 0 {
		in = append(e.pending, p...)
		e.pending = nil
	}
	var b strings.Builder
	for i := 0; i < len(in); {
		r, size := utf8.DecodeRune(in[i:])
		if r == utf8.RuneError && size <= 1 {
			if !utf8.FullRune(in[i:]) { // the rest of the sequence comes in the next write
				e.pending = append([]byte(nil), in[i:]...)
				break
			}
			e.escape(&b, r, in[i], true)
			i++
			continue
		}
		if e.control(r) {
			e.escape(&b, r, in[i], false)
		} else {
			b.Write(in[i : i+size])
		}
		i += size
	}
	if _, err := io.WriteString(e.w, b.String()); err != nil {
		return 0, err
	}
	return len(p), nil
}

// flush writes what is left of a UTF-8 sequence the last write began, as bytes that are not
// UTF-8: the end of the text has come.
func (e *escaper) flush() error {
	var b strings.Builder
	for _, c := range e.pending {
		e.escape(&b, utf8.RuneError, c, true)
	}
	e.pending = nil
	_, err := io.WriteString(e.w, b.String())
	return err
}
