package safetext_test

import (
	"encoding/json"
	"io"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/kafkapg/kafkapg/internal/safetext"
)

func TestTruncate(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		s    string
		n    int
		want string
	}{
		{name: "empty", s: "", n: 0, want: ""},
		{name: "shorter than n", s: "hello", n: 10, want: "hello"},
		{name: "exactly n", s: "hello", n: 5, want: "hello"},
		{name: "ascii cut", s: "hello world", n: 8, want: "hello…"},
		{name: "ascii one over", s: "hello", n: 4, want: "h…"},
		{name: "two-byte rune not split", s: "héllo", n: 5, want: "h…"},
		{name: "two-byte rune kept whole", s: "héllo", n: 6, want: "héllo"},
		{name: "three-byte runes", s: "日本語", n: 8, want: "日…"},
		{name: "three-byte rune boundary", s: "日本語日", n: 9, want: "日本…"},
		{name: "four-byte rune fits", s: "😀😀", n: 7, want: "😀…"},
		{name: "four-byte rune split", s: "😀😀", n: 6, want: "…"},
		{name: "marker alone", s: "abcdef", n: 3, want: "…"},
		{name: "multibyte exact fit", s: "日本語", n: 9, want: "日本語"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			if got := safetext.Truncate(tt.s, tt.n); got != tt.want {
				t.Errorf("Truncate(%q, %d) = %q, want %q", tt.s, tt.n, got, tt.want)
			}
		})
	}
}

func TestTruncateProperties(t *testing.T) {
	t.Parallel()
	inputs := []string{
		"", "a", "abc", "abcd", "hello, world",
		"é", "éé", "aé", "日本語のテキスト", "😀", "a😀b😀c", "ü日😀a",
		strings.Repeat("x", 50), strings.Repeat("ß", 20),
	}
	const mark = "…"
	for _, s := range inputs {
		// n below len(mark) is TestTruncateSmallerThanMarker's.
		for n := len(mark); n <= len(s)+2; n++ {
			got := safetext.Truncate(s, n)
			if len(got) > n {
				t.Errorf("Truncate(%q, %d) = %q: %d bytes, more than n", s, n, got, len(got))
			}
			if !utf8.ValidString(got) {
				t.Errorf("Truncate(%q, %d) = %q: not valid UTF-8", s, n, got)
			}
			if len(s) <= n {
				if got != s {
					t.Errorf("Truncate(%q, %d) = %q, want s unchanged", s, n, got)
				}
				continue
			}
			prefix, ok := strings.CutSuffix(got, mark)
			if !ok || !strings.HasPrefix(s, prefix) {
				t.Errorf("Truncate(%q, %d) = %q, want a prefix of s followed by %q", s, n, got, mark)
			}
			// The cut keeps as much as fits: one more rune would not.
			if ok && n >= len(mark) && len(prefix) < len(s) {
				_, size := utf8.DecodeRuneInString(s[len(prefix):])
				if len(prefix)+size+len(mark) <= n {
					t.Errorf("Truncate(%q, %d) = %q cut more than needed", s, n, got)
				}
			}
		}
	}
}

func TestTruncateSmallerThanMarker(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		s    string
		n    int
	}{
		{name: "n=0 ascii", s: "abcdef", n: 0},
		{name: "n=1 ascii", s: "abcdef", n: 1},
		{name: "n=2 ascii", s: "abcdef", n: 2},
		{name: "n=1 two-byte rune", s: "éé", n: 1},
		{name: "n=2 three-byte rune", s: "日本", n: 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got := safetext.Truncate(tt.s, tt.n)
			if len(got) > tt.n || !utf8.ValidString(got) {
				t.Errorf("Truncate(%q, %d) = %q (%d bytes), want valid UTF-8 of at most %d bytes", tt.s, tt.n, got, len(got), tt.n)
			}
		})
	}
}

func TestText(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		s    string
		n    int
		want string
	}{
		{name: "plain text unchanged", s: "handler failed: timeout", n: 100, want: "handler failed: timeout"},
		{name: "NUL escaped", s: "bad \x00 byte", n: 100, want: `bad \x00 byte`},
		{name: "invalid UTF-8 escaped", s: "bad payload b\x00\xff\xfex\xc3(", n: 100, want: `bad payload b\x00\xff\xfex\xc3(`},
		{name: "valid multibyte kept", s: "café \xff", n: 100, want: `café \xff`},
		{name: "escapes count towards n", s: "\x00\x00\x00\x00", n: 11, want: `\x00\x00…`},
		{name: "long plain text truncated", s: strings.Repeat("a", 50), n: 10, want: "aaaaaaa…"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			if got := safetext.Text(tt.s, tt.n); got != tt.want {
				t.Errorf("Text(%q, %d) = %q, want %q", tt.s, tt.n, got, tt.want)
			}
		})
	}
}

func FuzzText(f *testing.F) {
	f.Add("bad payload \x00\xff", 20)
	f.Add("ok", 5)
	f.Add(strings.Repeat("é\x00", 100), 7)
	f.Fuzz(func(t *testing.T, s string, n int) {
		n = n % 4096
		if n < 0 {
			n = -n
		}
		got := safetext.Text(s, n)
		if !utf8.ValidString(got) || strings.IndexByte(got, 0) >= 0 || len(got) > n {
			t.Fatalf("Text(%q, %d) = %q: want valid UTF-8, no NUL, at most n bytes", s, n, got)
		}
		if utf8.ValidString(s) && !strings.Contains(s, "\x00") && len(s) <= n && got != s {
			t.Fatalf("Text(%q, %d) = %q: text that fits must be unchanged", s, n, got)
		}
	})
}

// TestTerminalWriter: nothing a terminal takes for a command gets through, whatever bytes, and
// however the writes split them; text, tabs and newlines are kept.
func TestTerminalWriter(t *testing.T) {
	hostile := "h\x1b]0;TITLE\x07\x1b[2J ok\t\xc2\x9b31m é \u202eevil\n\xff\x00\x7f"
	want := `h\x1b]0;TITLE\x07\x1b[2J ok` + "\t" + `\x9b31m é \u202eevil` + "\n" + `\xff\x00\x7f`
	for split := range len(hostile) + 1 {
		var b strings.Builder
		w := safetext.TerminalWriter(&b)
		io.WriteString(w, hostile[:split])
		io.WriteString(w, hostile[split:])
		if got := b.String(); got != want {
			t.Errorf("split at %d: %q, want %q", split, got, want)
		}
	}
}

// TestJSONWriter: encoding/json escapes the C0 controls but writes C1 and bidirectional controls
// raw; JSONWriter escapes those too, and the result is the same JSON.
func TestJSONWriter(t *testing.T) {
	in := map[string]string{"k": "a\u009b31m\u202eb\x1b"}
	var b strings.Builder
	if err := json.NewEncoder(safetext.JSONWriter(&b)).Encode(in); err != nil {
		t.Fatal(err)
	}
	if strings.ContainsAny(b.String(), "\u009b\u202e\x1b") {
		t.Errorf("JSON output %q still has control characters", b.String())
	}
	var back map[string]string
	if err := json.Unmarshal([]byte(b.String()), &back); err != nil || back["k"] != in["k"] {
		t.Errorf("JSON output %q decodes to %q, %v; want %q", b.String(), back["k"], err, in["k"])
	}
}

// TestJSONWriterRawValues: JSON a program passes through (json.RawMessage: a record's value)
// keeps its bytes as they are, C1 controls and bytes that are not UTF-8 included; through
// JSONWriter it is valid JSON whatever the writes' split, which reads back with U+FFFD for each
// byte that is not UTF-8.
func TestJSONWriterRawValues(t *testing.T) {
	raw := json.RawMessage("{\"v\":\"a\u009b31m\u202eb\xffc\u2066\"}")
	want := strings.ToValidUTF8("a\u009b31m\u202eb\xffc\u2066", "\ufffd")
	var enc strings.Builder
	if err := json.NewEncoder(&enc).Encode(map[string]any{"value": raw, "text": "x\u009by"}); err != nil {
		t.Fatal(err)
	}
	in := enc.String()
	for split := range len(in) + 1 {
		var b strings.Builder
		w := safetext.JSONWriter(&b)
		io.WriteString(w, in[:split])
		io.WriteString(w, in[split:])
		out := b.String()
		if !json.Valid([]byte(out)) || !utf8.ValidString(out) || strings.ContainsAny(out, "\u009b\u202e\u2066") {
			t.Fatalf("split at %d: %q is not JSON, or has control characters raw", split, out)
		}
		var back struct {
			Value struct{ V string }
			Text  string
		}
		if err := json.Unmarshal([]byte(out), &back); err != nil || back.Value.V != want || back.Text != "x\u009by" {
			t.Fatalf("split at %d: %q reads back as %+v, %v", split, out, back, err)
		}
	}
}

// TestHTML: what html/template leaves as it is (bidirectional controls, ESC, BEL, C1, bytes that
// are not UTF-8) is nowhere raw in the page: in text a visible escape, inside a tag a character
// reference (a form gets its value back); markup, text, tabs, newlines and carriage returns are
// kept.
func TestHTML(t *testing.T) {
	page := "<input type=\"hidden\" name=\"error\" value=\"a\u202eb\x1b\xff\">\n<td>x\x1b[31m\x07 é \u202egpj.exe\u2066\u200f\u061c\u009b\xff\x00\r\n\t</td>\xe2\x80"
	want := `<input type="hidden" name="error" value="a&#x202e;b&#x1b;&#xfffd;">` + "\n" +
		`<td>x\x1b[31m\x07 é \u202egpj.exe\u2066\u200f\u061c\x9b\xff\x00` + "\r\n\t</td>" + `\xe2\x80`
	if got := safetext.HTML(page); got != want {
		t.Errorf("HTML:\n%q, want\n%q", got, want)
	}
	if got, want := safetext.Visible("a\u202eb\x1b\xffc\xe2"), `a\u202eb\x1b\xffc\xe2`; got != want {
		t.Errorf("Visible: %q, want %q", got, want)
	}
}
