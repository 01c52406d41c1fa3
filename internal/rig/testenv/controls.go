package testenv

import (
	"fmt"
	"strings"
	"unicode/utf8"
)

// RawControl names the first character in s a terminal takes for a command (C0 but tab and
// newline, DEL, C1, the bidirectional formatting characters) or byte that is not UTF-8, or
// returns "". It is written apart from internal/safetext, whose output tests check with it.
func RawControl(s string) string {
	for i, r := range s {
		switch {
		case r == utf8.RuneError && !strings.HasPrefix(s[i:], "\ufffd"):
			return fmt.Sprintf("the byte %#x", s[i])
		case r == '\t' || r == '\n':
		case r < 0x20 || r == 0x7f || r >= 0x80 && r <= 0x9f || r >= 0x202a && r <= 0x202e || r >= 0x2066 && r <= 0x2069 ||
			r == 0x200e || r == 0x200f || r == 0x061c:
			return fmt.Sprintf("%U", r)
		}
	}
	return ""
}
