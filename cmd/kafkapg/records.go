package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"os"
	"slices"
	"strings"
	"sync"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/safetext"
)

// maxLine bounds a line of produce's input: a record's value, or its envelope.
const maxLine = 16 << 20

// headerFlags is a repeatable -header name=value.
type headerFlags []kgo.RecordHeader

func (h *headerFlags) String() string { return fmt.Sprint(len(*h)) }
func (h *headerFlags) Set(v string) error {
	name, value, ok := strings.Cut(v, "=")
	if !ok || name == "" {
		return errors.New("want name=value")
	}
	*h = append(*h, kgo.RecordHeader{Key: name, Value: []byte(value)})
	return nil
}

// envelope is a line of produce -envelope.
type envelope struct {
	Key     *string           `json:"key"`
	Value   json.RawMessage   `json:"value"`
	Headers map[string]string `json:"headers"`
}

// produceCmd puts records on a topic.
func produceCmd(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("kafkapg produce", flag.ContinueOnError)
	fs.SetOutput(stderr)
	topic := fs.String("topic", "", "the topic (required)")
	key := fs.String("key", "", "the records' key")
	keyField := fs.String("key-field", "", "take each record's key from this field of its JSON value (dots for nested fields: order.id)")
	value := fs.String("value", "", "produce one record with this value (and -key), instead of reading lines")
	envelopes := fs.Bool("envelope", false, `each line is {"key": "...", "value": <JSON, or a string for text>, "headers": {"name": "value"}}`)
	var headers headerFlags
	fs.Var(&headers, "header", "a header name=value on every record (repeatable)")
	brokerFlag := fs.String("brokers", "", "brokers, host:port,... (default: KAFKA_BROKERS, else the dev loop's); the login: KAFKA_SASL_*")
	dir := fs.String("dir", ".kafkapg", "the dev loop's -dir, to find its broker")
	fs.Usage = func() {
		fmt.Fprint(stderr, `usage: kafkapg produce -topic T [flags] [FILE ...]

Without -value, each line of the files (or of stdin, or "-") is one record: its value as
written (JSON lines of events), or with -envelope its key, value and headers.

`)
		fs.PrintDefaults()
	}
	if err := parse(fs, args); err != nil {
		return err
	}
	switch {
	case *topic == "":
		return usagef("-topic is required")
	case *key != "" && *keyField != "":
		return usagef("-key and -key-field: give one")
	case *envelopes && (*key != "" || *keyField != ""):
		return usagef("-envelope lines carry their own key: -key and -key-field do not apply")
	case fs.NArg() > 0 && *value != "":
		return usagef("-value and files: give one")
	}
	kafka, err := kafkaFor(*brokerFlag, *dir)
	if err != nil {
		return err
	}
	cl, err := kafka.client(kgo.DefaultProduceTopic(*topic), kgo.ProducerLinger(5*time.Millisecond),
		kgo.MaxBufferedRecords(10_000), kgo.ProducerBatchMaxBytes(maxLine+1024))
	if err != nil {
		return err
	}
	defer cl.Close()
	if err := topicExists(ctx, cl, *topic); err != nil {
		return err
	}

	mk := func(value []byte) (*kgo.Record, error) {
		r := &kgo.Record{Topic: *topic, Value: value, Headers: slices.Clone(headers)}
		switch {
		case *key != "":
			r.Key = []byte(*key)
		case *keyField != "":
			k, err := jsonField(value, *keyField)
			if err != nil {
				return nil, err
			}
			r.Key = k
		}
		return r, nil
	}
	var n int
	var mu sync.Mutex
	var produceErr error
	produce := func(r *kgo.Record) {
		n++
		cl.Produce(ctx, r, func(_ *kgo.Record, err error) {
			mu.Lock()
			defer mu.Unlock()
			if err != nil && produceErr == nil {
				produceErr = err
			}
		})
	}
	if fs.NArg() == 0 && *value != "" {
		r, err := mk([]byte(*value))
		if err != nil {
			return err
		}
		produce(r)
	} else {
		files := fs.Args()
		if len(files) == 0 {
			files = []string{"-"}
		}
		for _, name := range files {
			if err := readLines(name, stdin, func(line int, b []byte) error {
				var r *kgo.Record
				var err error
				if *envelopes {
					r, err = fromEnvelope(*topic, b, headers)
				} else {
					r, err = mk(b)
				}
				if err != nil {
					return fmt.Errorf("%s:%d: %w", name, line, err)
				}
				produce(r)
				return nil
			}); err != nil {
				return err
			}
		}
	}
	if err := cl.Flush(ctx); err != nil {
		return err
	}
	mu.Lock()
	defer mu.Unlock()
	if produceErr != nil {
		return fmt.Errorf("produce to %s: %w", *topic, produceErr)
	}
	fmt.Fprintf(stderr, "kafkapg produce: %d records to %s\n", n, *topic)
	return nil
}

// readLines calls fn with each non-blank line of the file name ("-": stdin), numbered from 1.
func readLines(name string, stdin io.Reader, fn func(line int, b []byte) error) error {
	in := stdin
	if name != "-" {
		f, err := os.Open(name)
		if err != nil {
			return err
		}
		defer f.Close()
		in = f
	}
	sc := bufio.NewScanner(in)
	sc.Buffer(make([]byte, 64<<10), maxLine)
	line := 0
	for sc.Scan() {
		line++
		b := bytes.TrimRight(sc.Bytes(), "\r")
		if len(bytes.TrimSpace(b)) == 0 {
			continue
		}
		if err := fn(line, bytes.Clone(b)); err != nil {
			return err
		}
	}
	if errors.Is(sc.Err(), bufio.ErrTooLong) {
		return fmt.Errorf("%s:%d: a line longer than %d bytes", name, line+1, maxLine)
	}
	return sc.Err()
}

// fromEnvelope parses a line of produce -envelope.
func fromEnvelope(topic string, line []byte, headers []kgo.RecordHeader) (*kgo.Record, error) {
	var e envelope
	dec := json.NewDecoder(bytes.NewReader(line))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&e); err != nil {
		return nil, fmt.Errorf(`not an envelope {"key": …, "value": …, "headers": {…}}: %v`, err)
	}
	r := &kgo.Record{Topic: topic, Headers: slices.Clone(headers)}
	if e.Key != nil {
		r.Key = []byte(*e.Key)
	}
	var s string
	switch {
	case len(e.Value) == 0 || string(e.Value) == "null":
	case json.Unmarshal(e.Value, &s) == nil:
		r.Value = []byte(s)
	default:
		var b bytes.Buffer
		if err := json.Compact(&b, e.Value); err != nil {
			return nil, err
		}
		r.Value = b.Bytes()
	}
	for _, name := range slices.Sorted(maps.Keys(e.Headers)) {
		r.Headers = append(r.Headers, kgo.RecordHeader{Key: name, Value: []byte(e.Headers[name])})
	}
	return r, nil
}

// jsonField returns the field at path (dots for nested fields) of the JSON object value: a
// string's text, or another value's JSON.
func jsonField(value []byte, path string) ([]byte, error) {
	raw := json.RawMessage(value)
	for _, f := range strings.Split(path, ".") {
		var obj map[string]json.RawMessage
		if err := json.Unmarshal(raw, &obj); err != nil || obj == nil {
			return nil, fmt.Errorf("-key-field %s: the value is not a JSON object where %q should be", path, f)
		}
		v, ok := obj[f]
		if !ok {
			return nil, fmt.Errorf("-key-field %s: the value has no field %q", path, f)
		}
		raw = v
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return []byte(s), nil
	}
	var b bytes.Buffer
	if err := json.Compact(&b, raw); err != nil {
		return nil, err
	}
	return b.Bytes(), nil
}

// topicExists returns an error naming topic if the broker does not have it.
func topicExists(ctx context.Context, cl *kgo.Client, topic string) error {
	ts, err := kadm.NewClient(cl).ListTopics(ctx, topic)
	if err != nil {
		return fmt.Errorf("ask the broker about topic %s: %w", topic, err)
	}
	if d, ok := ts[topic]; !ok || d.Err != nil {
		return fmt.Errorf("topic %s does not exist: create it (go tool kafkapg topics create %s, or kafkapg dev -topics %s)", topic, topic, topic)
	}
	return nil
}

// shown is a record as consume prints it. A key, value or header value that is valid UTF-8 is
// a string (a value that is JSON is that JSON); other bytes are in the *_base64 field instead.
type shown struct {
	Partition   int32             `json:"partition"`
	Offset      int64             `json:"offset"`
	Timestamp   time.Time         `json:"timestamp"`
	Key         *string           `json:"key,omitempty"`
	KeyBase64   []byte            `json:"key_base64,omitempty"`
	Value       json.RawMessage   `json:"value,omitempty"`
	ValueBase64 []byte            `json:"value_base64,omitempty"`
	Headers     map[string]string `json:"headers,omitempty"`
}

func show(r *kgo.Record) shown {
	s := shown{Partition: r.Partition, Offset: r.Offset, Timestamp: r.Timestamp.UTC()}
	if r.Key != nil {
		if utf8.Valid(r.Key) {
			k := string(r.Key)
			s.Key = &k
		} else {
			s.KeyBase64 = r.Key
		}
	}
	switch {
	case r.Value == nil:
	case json.Valid(r.Value):
		var b bytes.Buffer
		_ = json.Compact(&b, r.Value)
		s.Value = b.Bytes()
	case utf8.Valid(r.Value):
		s.Value, _ = json.Marshal(string(r.Value))
	default:
		s.ValueBase64 = r.Value
	}
	for _, h := range r.Headers {
		if s.Headers == nil {
			s.Headers = map[string]string{}
		}
		v := string(h.Value)
		if !utf8.Valid(h.Value) {
			v = "base64:" + base64.StdEncoding.EncodeToString(h.Value)
		}
		s.Headers[h.Key] = v
	}
	return s
}

// consumeCmd prints a topic's records.
func consumeCmd(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("kafkapg consume", flag.ContinueOnError)
	fs.SetOutput(stderr)
	topic := fs.String("topic", "", "the topic (required)")
	from := fs.String("from", "start", "start or end: where to begin in each partition")
	limit := fs.Int("n", 0, "stop after this many records (0: no limit)")
	follow := fs.Bool("follow", false, "keep printing new records until Ctrl-C (or -n); without it, stop at the end offsets the topic had at the start")
	wait := fs.Duration("wait", 0, "with -n: wait this long for the records to arrive (0: as -follow)")
	brokerFlag := fs.String("brokers", "", "brokers, host:port,... (default: KAFKA_BROKERS, else the dev loop's); the login: KAFKA_SASL_*")
	dir := fs.String("dir", ".kafkapg", "the dev loop's -dir, to find its broker")
	fs.Usage = func() {
		fmt.Fprint(stderr, `usage: kafkapg consume -topic T [flags]

Prints each record as a line of JSON: partition, offset, timestamp, key, value (the value's
JSON when it is JSON, else its text; bytes that are not UTF-8 in key_base64, value_base64)
and headers. It joins no consumer group and commits nothing.

`)
		fs.PrintDefaults()
	}
	if err := parse(fs, args); err != nil {
		return err
	}
	switch {
	case *topic == "":
		return usagef("-topic is required")
	case *from != "start" && *from != "end":
		return usagef("-from %q: want start or end", *from)
	case *limit < 0:
		return usagef("-n must not be negative")
	}
	kafka, err := kafkaFor(*brokerFlag, *dir)
	if err != nil {
		return err
	}
	start := kgo.NewOffset().AtStart()
	if *from == "end" {
		start = kgo.NewOffset().AtEnd()
	}
	admCl, err := kafka.client()
	if err != nil {
		return err
	}
	defer admCl.Close()
	if err := topicExists(ctx, admCl, *topic); err != nil {
		return err
	}
	// Without -follow (and without -n): read up to the end offsets as of now.
	var until map[int32]int64
	if !*follow && *limit == 0 {
		ends, err := kadm.NewClient(admCl).ListEndOffsets(ctx, *topic)
		if err == nil {
			err = ends.Error()
		}
		if err != nil {
			return fmt.Errorf("end offsets of %s: %w", *topic, err)
		}
		until = map[int32]int64{}
		starts, err := kadm.NewClient(admCl).ListStartOffsets(ctx, *topic)
		if err == nil {
			err = starts.Error()
		}
		if err != nil {
			return fmt.Errorf("start offsets of %s: %w", *topic, err)
		}
		ends.Each(func(o kadm.ListedOffset) {
			first, _ := starts.Lookup(*topic, o.Partition)
			if o.Offset > first.Offset && *from == "start" {
				until[o.Partition] = o.Offset
			}
		})
		if len(until) == 0 {
			return nil
		}
	}
	if *limit > 0 && *wait > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, *wait)
		defer cancel()
	}
	cl, err := kafka.client(kgo.ConsumeTopics(*topic), kgo.ConsumeResetOffset(start),
		kgo.FetchMaxWait(500*time.Millisecond))
	if err != nil {
		return err
	}
	defer cl.Close()
	// A record's bytes are anyone's: JSONWriter escapes what a terminal would obey (C1 and
	// bidirectional controls, which encoding/json writes raw) the way JSON escapes, so that the
	// lines stay JSON.
	enc := json.NewEncoder(safetext.JSONWriter(stdout))
	n := 0
	for {
		fs := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			if *limit > 0 && n < *limit && *wait > 0 {
				return fmt.Errorf("%d of %d records within %s", n, *limit, *wait)
			}
			return nil
		}
		for _, e := range fs.Errors() {
			return fmt.Errorf("fetch %s: %w", *topic, e.Err)
		}
		var err error
		fs.EachRecord(func(r *kgo.Record) {
			if err != nil || (*limit > 0 && n >= *limit) {
				return
			}
			if until != nil {
				end, ok := until[r.Partition]
				if !ok || r.Offset >= end {
					return
				}
				if r.Offset == end-1 {
					delete(until, r.Partition)
				}
			}
			n++
			err = enc.Encode(show(r))
		})
		if err != nil {
			return err
		}
		if (*limit > 0 && n >= *limit) || (until != nil && len(until) == 0) {
			return nil
		}
	}
}

// topicsCmd lists topics, or creates some.
func topicsCmd(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("kafkapg topics", flag.ContinueOnError)
	fs.SetOutput(stderr)
	partitions := fs.Int("partitions", 3, "partitions of a topic created without :PARTITIONS")
	brokerFlag := fs.String("brokers", "", "brokers, host:port,... (default: KAFKA_BROKERS, else the dev loop's); the login: KAFKA_SASL_*")
	dir := fs.String("dir", ".kafkapg", "the dev loop's -dir, to find its broker")
	fs.Usage = func() {
		fmt.Fprint(stderr, "usage: kafkapg topics [flags]                      list topics\n       kafkapg topics [flags] create NAME[:PARTITIONS] ...\n\n")
		fs.PrintDefaults()
	}
	if err := parse(fs, args); err != nil {
		return err
	}
	kafka, err := kafkaFor(*brokerFlag, *dir)
	if err != nil {
		return err
	}
	switch {
	case fs.NArg() == 0:
		cl, err := kafka.client()
		if err != nil {
			return err
		}
		defer cl.Close()
		ts, err := kadm.NewClient(cl).ListTopics(ctx)
		if err != nil {
			return err
		}
		tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "TOPIC\tPARTITIONS")
		for _, name := range ts.Names() {
			fmt.Fprintf(tw, "%s\t%d\n", name, len(ts[name].Partitions))
		}
		return tw.Flush()
	case fs.Arg(0) == "create" && fs.NArg() > 1:
		specs, err := parseTopics(strings.Join(fs.Args()[1:], ","), *partitions)
		if err != nil {
			return err
		}
		created, err := ensureTopics(ctx, kafka, specs)
		if err != nil {
			return err
		}
		for _, t := range specs {
			if created[t.name] {
				fmt.Fprintf(stderr, "kafkapg topics: created %s (%d partitions)\n", t.name, t.partitions)
			} else {
				fmt.Fprintf(stderr, "kafkapg topics: %s exists\n", t.name)
			}
		}
		return nil
	}
	return usagef("want no arguments (list) or create NAME[:PARTITIONS] ...")
}
