package streams

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
)

// Spans is a set of int64s as sorted, disjoint, non-adjacent half-open ranges: a stream's numbers
// not applied yet, below its highest applied. Postgres keeps it as an int8multirange.
type Spans []Span

// Span is the half-open range [Lo, Hi).
type Span struct{ Lo, Hi int64 }

// Has reports whether q is in ss.
func (ss Spans) Has(q int64) bool {
	i, found := slices.BinarySearchFunc(ss, q, func(s Span, q int64) int {
		switch {
		case s.Hi <= q:
			return -1
		case s.Lo > q:
			return 1
		}
		return 0
	})
	return found && i >= 0
}

// AddAbove returns ss with [lo, hi) added, where lo is at or above every span of ss.
func (ss Spans) AddAbove(lo, hi int64) Spans {
	if lo >= hi {
		return ss
	}
	if n := len(ss); n > 0 && ss[n-1].Hi == lo {
		ss = slices.Clone(ss)
		ss[n-1].Hi = hi
		return ss
	}
	return append(slices.Clip(ss), Span{lo, hi})
}

// Remove returns ss without q. It never changes the array ss shares with its caller.
func (ss Spans) Remove(q int64) Spans {
	for i, s := range ss {
		if q < s.Lo || q >= s.Hi {
			continue
		}
		out := make(Spans, 0, len(ss)+1)
		out = append(out, ss[:i]...)
		if s.Lo < q {
			out = append(out, Span{s.Lo, q})
		}
		if q+1 < s.Hi {
			out = append(out, Span{q + 1, s.Hi})
		}
		return append(out, ss[i+1:]...)
	}
	return ss
}

// Len is how many numbers ss holds.
func (ss Spans) Len() int64 {
	var n int64
	for _, s := range ss {
		n += s.Hi - s.Lo
	}
	return n
}

// String is ss as Postgres writes an int8multirange: "{[1,5),[7,8)}".
func (ss Spans) String() string {
	var b strings.Builder
	b.WriteByte('{')
	for i, s := range ss {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, "[%d,%d)", s.Lo, s.Hi)
	}
	b.WriteByte('}')
	return b.String()
}

// MarshalText writes ss as String does.
func (ss Spans) MarshalText() ([]byte, error) { return []byte(ss.String()), nil }

// UnmarshalText reads what MarshalText wrote.
func (ss *Spans) UnmarshalText(b []byte) error {
	v, err := ParseSpans(string(b))
	*ss = v
	return err
}

// ParseSpans reads an int8multirange as Postgres writes it (canonical: "[lo,hi)" ranges).
func ParseSpans(text string) (Spans, error) {
	body, ok := strings.CutPrefix(text, "{")
	if body, ok = strings.CutSuffix(body, "}"); !ok {
		return nil, fmt.Errorf("not a multirange: %q", text)
	}
	var out Spans
	for body != "" {
		r, rest, closed := strings.Cut(body, ")")
		lo, hi, ok := strings.Cut(strings.TrimPrefix(r, "["), ",")
		l, err1 := strconv.ParseInt(lo, 10, 64)
		h, err2 := strconv.ParseInt(hi, 10, 64)
		if !closed || !ok || !strings.HasPrefix(r, "[") || err1 != nil || err2 != nil || l >= h ||
			(len(out) > 0 && out[len(out)-1].Hi >= l) {
			return nil, fmt.Errorf("not a multirange of int8: %q", text)
		}
		out = append(out, Span{l, h})
		if body, ok = strings.CutPrefix(rest, ","); (!ok && rest != "") || (ok && body == "") {
			return nil, fmt.Errorf("not a multirange of int8: %q", text)
		}
	}
	return out, nil
}
