package console

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"html/template"
	"net/url"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/kafkapg/kafkapg/internal/ops"
	"github.com/kafkapg/kafkapg/internal/safetext"
	"github.com/kafkapg/kafkapg/processor/schemaregistry"
)

// maxShown bounds the bytes of a value a page shows.
const maxShown = 64 << 10

// decode renders a record value for a person: pretty-printed JSON, text, or a hex dump, and says
// which.
func decode(v []byte) (shown, encoding string) {
	if v == nil {
		return "(null)", "null"
	}
	cut := ""
	if len(v) > maxShown {
		v, cut = v[:maxShown], fmt.Sprintf("\n… (%d bytes more)", len(v)-maxShown)
	}
	var out bytes.Buffer
	if json.Valid(v) && json.Indent(&out, v, "", "  ") == nil {
		return out.String() + cut, "json"
	}
	if utf8.Valid(v) && printable(v) {
		return string(v) + cut, "text"
	}
	return hex.Dump(v) + cut, "hex"
}

// decodeValue renders a record value for a person: decoded with its schema when it is in the
// Schema Registry's wire format and the console has the registry (encoding says what it is),
// else as decode does; notDecoded says why a value in the wire format was not decoded. A
// truncated value (the page reads its first maxShown bytes) cannot be.
func (c *Console) decodeValue(ctx context.Context, v []byte, truncated bool) (shown, encoding, notDecoded string) {
	if c.cfg.Registry != nil && schemaregistry.LooksLikeWireFormat(v) {
		if truncated {
			notDecoded = fmt.Sprintf("not decoded with its schema: only its first %d bytes are read", len(v))
		} else {
			ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			rd, err := c.cfg.Registry.Render(ctx, v)
			if err == nil {
				return rd.JSON, "decoded: " + rd.Describe(), ""
			}
			notDecoded = "not decoded with its schema: " + err.Error()
		}
	}
	shown, encoding = decode(v)
	return shown, encoding, notDecoded
}

// printable reports whether text has no control characters but tabs and line breaks.
func printable(text []byte) bool {
	for _, r := range string(text) {
		if r < 0x20 && r != '\n' && r != '\r' && r != '\t' || r == 0x7f {
			return false
		}
	}
	return true
}

// Every page goes through safetext.HTML as it is sent (console.go, renderStatus): what came from
// outside (error messages, actors, reasons, keys, values, topics) shows its controls as visible
// escapes in text, and keeps them as character references inside tags, where a form needs the
// exact value back. An attribute a person reads (a title) takes visible, which shows them there.
var funcs = template.FuncMap{
	"visible": safetext.Visible,
	"list":    func(s ...string) []string { return s },
	// query is a URL's query as url.Values encodes it: each name and value percent-encoded, so
	// that only its own '=' and '&' are left (html/template would escape those too, and the
	// link would lose its filter).
	"query": func(v url.Values) template.URL { return template.URL(v.Encode()) },
	"key": func(k []byte) string {
		if k == nil {
			return "(no key)"
		}
		return ops.KeyText(k)
	},
	"ago": func(t time.Time) string {
		if t.IsZero() {
			return "—"
		}
		d := time.Since(t).Round(time.Second)
		switch {
		case d < time.Minute:
			return fmt.Sprintf("%ds ago", int(d.Seconds()))
		case d < time.Hour:
			return fmt.Sprintf("%dm ago", int(d.Minutes()))
		case d < 48*time.Hour:
			return fmt.Sprintf("%dh ago", int(d.Hours()))
		default:
			return fmt.Sprintf("%dd ago", int(d.Hours()/24))
		}
	},
	"time": func(t time.Time) string {
		if t.IsZero() {
			return "—"
		}
		return t.UTC().Format("2006-01-02 15:04:05Z")
	},
	"bytes": func(b []byte) string {
		if utf8.Valid(b) && printable(b) {
			return string(b)
		}
		return "0x" + hex.EncodeToString(b)
	},
	"rate": func(v float64) string {
		if v >= 100 {
			return fmt.Sprintf("%.0f", v)
		}
		return fmt.Sprintf("%.1f", v)
	},
	"hex":       func(b []byte) string { return hex.EncodeToString(b) },
	"partition": partitionText,
	"oneline":   oneLineText,
	"dur": func(d time.Duration) string {
		if d < time.Second {
			return d.Round(time.Millisecond).String()
		}
		h := humanDuration(d) // 10m00s reads 10m, 24h00m 24h
		return strings.TrimSuffix(strings.TrimSuffix(h, "00s"), "00m")
	},
	"tierTotal": func(tiers []tierRow) int {
		n := 0
		for _, t := range tiers {
			n += t.Records
		}
		return n
	},
	"deref": func(p *int64) string {
		if p == nil {
			return "—"
		}
		return fmt.Sprint(*p)
	},
	"num": func(n any) string {
		s := fmt.Sprint(n) // an integer of any type
		var out []byte
		for i := range len(s) {
			if i > 0 && (len(s)-i)%3 == 0 && s[i-1] != '-' {
				out = append(out, ',')
			}
			out = append(out, s[i])
		}
		return string(out)
	},
}
