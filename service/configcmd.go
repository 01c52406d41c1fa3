package service

import (
	"cmp"
	"crypto/tls"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"os"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kafkapg/kafkapg/internal/console"
	"github.com/kafkapg/kafkapg/internal/safetext"
	"github.com/kafkapg/kafkapg/processor"
	"github.com/kafkapg/kafkapg/retrytopics"
)

// The config command answers "what is this pod running with": every variable the service reads
// with the value in force and where it came from (the environment or the default), and for each
// topic the settings in force after the per-topic variables and the handlers' Go settings are
// merged in, with the topics its failures go to. Secrets are redacted.

// setting is one variable, as the config command shows it.
type setting struct {
	Name  string `json:"name"`
	Value string `json:"value"`
	From  string `json:"from"` // "environment", "default" or "unset"
}

// topicSettingsShown is one topic's settings in force, as the config command shows them.
type topicSettingsShown struct {
	Topic          string            `json:"topic"`
	Handler        string            `json:"handler"`
	HandlerType    string            `json:"handler_type"`
	RetryTiers     []string          `json:"retry_tiers"`
	TierTopics     []string          `json:"tier_topics"`
	DLQTopic       string            `json:"dlq_topic"`
	LocalAttempts  int               `json:"local_attempts"`
	OnDeadLetter   string            `json:"on_dead_letter"`
	MaxRecordBytes int               `json:"max_record_bytes"`
	Concurrency    int               `json:"concurrency"`
	IdempotencyKey string            `json:"idempotency_key"`
	ValueFormat    string            `json:"value_format"` // how values are decoded: none, avro, avro into main.Order, ...
	KeyFormat      string            `json:"key_format"`
	From           map[string]string `json:"from"` // setting -> where its value came from
}

// configShown is the config command's output.
type configShown struct {
	Variables []setting            `json:"variables"`
	Topics    []topicSettingsShown `json:"topics"`
	Handlers  []string             `json:"handlers"`
}

// configCmd prints the configuration in force and exits.
func configCmd(args []string, hs *registry, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet(progName()+" config", flag.ContinueOnError)
	fs.SetOutput(stderr)
	asJSON := fs.Bool("json", false, "print JSON instead of a table")
	fs.Usage = func() {
		fmt.Fprintf(stderr, "usage: %s config [--json]\n\nPrints the configuration in force (the environment, the handlers' Go settings and the defaults,\nmerged; secrets redacted), as run would use it, and exits.\n", progName())
	}
	if err := parse(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return usagef("config takes no arguments, got %q", fs.Args())
	}
	e, err := loadEnv(hs)
	if err != nil {
		return err
	}
	shown := e.shown(hs)
	// Values are anyone's text (a topic, a handler's name): escaped for the medium they go to.
	if *asJSON {
		enc := json.NewEncoder(safetext.JSONWriter(stdout))
		enc.SetIndent("", "  ")
		return enc.Encode(shown)
	}
	stdout = safetext.TerminalWriter(stdout)
	fmt.Fprintf(stdout, "# %s: the configuration in force (environment, Go settings and defaults merged; secrets redacted)\n", progName())
	tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "VARIABLE\tVALUE\tFROM")
	for _, s := range shown.Variables {
		fmt.Fprintf(tw, "%s\t%s\t%s\n", s.Name, cmp.Or(s.Value, `""`), s.From)
	}
	tw.Flush()
	for _, t := range shown.Topics {
		fmt.Fprintf(stdout, "\ntopic %s\n", t.Topic)
		tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
		row := func(what, value, from string) { fmt.Fprintf(tw, "  %s\t%s\t%s\n", what, value, from) }
		row("handler", t.Handler+" ("+t.HandlerType+")", t.From["handler"])
		row("retry tiers", cmp.Or(strings.Join(t.RetryTiers, ", "), "none: dead-lettered after the local attempts"), t.From["retry_tiers"])
		for i, tt := range t.TierTopics {
			row(fmt.Sprintf("  tier %d topic", i+1), tt, "")
		}
		row("dead-letter topic", t.DLQTopic, "")
		row("local attempts", fmt.Sprint(t.LocalAttempts), t.From["local_attempts"])
		row("on dead letter", t.OnDeadLetter, t.From["on_dead_letter"])
		row("max record bytes", fmt.Sprint(t.MaxRecordBytes), t.From["max_record_bytes"])
		row("concurrency", fmt.Sprint(t.Concurrency), t.From["concurrency"])
		row("idempotency key", t.IdempotencyKey, t.From["idempotency_key"])
		row("value format", t.ValueFormat, t.From["value_format"])
		row("key format", t.KeyFormat, t.From["key_format"])
		tw.Flush()
	}
	return nil
}

// shown returns the configuration in force, for the config command.
func (e *env) shown(hs *registry) configShown {
	out := configShown{Handlers: hs.names}
	e.eachVariable(func(name, value string, hasDefault bool) {
		from := "unset"
		switch _, ok := os.LookupEnv(name); {
		case ok: // set, even empty: envconfig then takes the empty value, not the default
			from = "environment"
		case hasDefault:
			from = "default"
		case name == "HANDLER" && value != "":
			from = "the binary's only handler"
		}
		out.Variables = append(out.Variables, setting{Name: name, Value: redact(name, value), From: from})
	})
	for _, t := range e.KafkaTopics {
		out.Topics = append(out.Topics, e.topicShown(hs, t))
	}
	return out
}

// eachVariable calls fn with each variable the service reads, in the order of the structs'
// fields, with its value in e and whether it has a default.
func (e *env) eachVariable(fn func(name, value string, hasDefault bool)) {
	var walk func(v reflect.Value)
	walk = func(v reflect.Value) {
		for i := range v.NumField() {
			f := v.Type().Field(i)
			if f.Anonymous && f.Type.Kind() == reflect.Struct {
				walk(v.Field(i))
				continue
			}
			name := f.Tag.Get("envconfig")
			if name == "" {
				continue
			}
			_, hasDefault := f.Tag.Lookup("default")
			fn(name, formatValue(v.Field(i)), hasDefault)
		}
	}
	walk(reflect.ValueOf(e).Elem())
}

// formatValue formats a configuration field's value as the variable would be written.
func formatValue(v reflect.Value) string {
	switch x := v.Interface().(type) {
	case []string:
		return strings.Join(x, ",")
	case batchWait:
		if time.Duration(x) == processor.NoBatchWait {
			return "none"
		}
		return time.Duration(x).String()
	case time.Duration:
		return x.String()
	}
	return fmt.Sprint(v.Interface())
}

// redacted replaces a secret.
const redacted = "REDACTED"

// redact returns value, the value of variable name, with any secret in it replaced.
func redact(name, value string) string {
	if value == "" {
		return ""
	}
	switch name {
	case "OPERATOR_TOKEN", "KAFKA_SASL_PASSWORD", "SCHEMA_REGISTRY_PASSWORD", "SCHEMA_REGISTRY_BEARER_TOKEN":
		return redacted
	case "CONSOLE_USERS", "CONSOLE_TOKENS", "OPERATOR_TOKENS":
		parse := console.ParseUsers
		if name != "CONSOLE_USERS" {
			parse = console.ParseTokens
		}
		users, err := parse(value)
		if err != nil {
			return redacted
		}
		var entries []string
		for _, u := range users {
			entries = append(entries, u.Name+":"+string(u.Role)+":"+redacted)
		}
		return strings.Join(entries, ",")
	case "DATABASE_URL":
		return showDSN(value)
	}
	return value
}

// showDSN returns a connection string as pgx, the parser that connects with it, reads it:
// re-rendered from pgx's parse as key=value pairs, with every secret pgx knows left out or
// replaced (password, and sslpassword, which pgx keeps to itself), so that no spelling of a
// secret (a '#' or several hosts in a URL, an escaped space in a key=value string) can reach the
// output without pgx having taken it for one. A string pgx refuses is shown as a placeholder and
// pgx's reason with nothing of the string in it (see dsnError).
func showDSN(dsn string) string {
	// pgxpool's parse is the one run makes (it knows pool_* and pgx's own parameters); pgconn's
	// keeps those as runtime parameters, which is how they are shown.
	if _, err := pgxpool.ParseConfig(dsn); err != nil {
		return "(not a connection string pgx accepts: " + dsnError(dsn, err) + ")"
	}
	cfg, err := pgconn.ParseConfig(dsn)
	if err != nil {
		return "(not a connection string pgx accepts: " + dsnError(dsn, err) + ")"
	}
	var pairs []string
	add := func(k, v string) { pairs = append(pairs, k+"="+kvQuote(v)) }
	// Each host appears once per TLS attempt (sslmode=prefer tries TLS, then without).
	type target struct {
		host string
		port uint16
	}
	var targets []target
	tlsOf := map[target][]*tls.Config{}
	for _, f := range append([]*pgconn.FallbackConfig{{Host: cfg.Host, Port: cfg.Port, TLSConfig: cfg.TLSConfig}}, cfg.Fallbacks...) {
		t := target{f.Host, f.Port}
		if _, seen := tlsOf[t]; !seen {
			targets = append(targets, t)
		}
		tlsOf[t] = append(tlsOf[t], f.TLSConfig)
	}
	var hosts, ports []string
	sslmode := ""
	for _, t := range targets {
		hosts = append(hosts, t.host)
		ports = append(ports, fmt.Sprint(t.port))
		if !strings.HasPrefix(t.host, "/") { // a Unix socket has no TLS
			sslmode = sslMode(tlsOf[t])
		}
	}
	add("host", strings.Join(hosts, ","))
	add("port", strings.Join(ports, ","))
	if cfg.User != "" {
		add("user", cfg.User)
	}
	if cfg.Password != "" {
		add("password", redacted)
	}
	if cfg.Database != "" {
		add("dbname", cfg.Database)
	}
	if sslmode != "" {
		add("sslmode", sslmode)
	}
	if cfg.SSLNegotiation != "" {
		add("sslnegotiation", cfg.SSLNegotiation)
	}
	if cfg.SSLCertMode != "" && cfg.SSLCertMode != "allow" {
		add("sslcertmode", cfg.SSLCertMode)
	}
	if cfg.ConnectTimeout != 0 {
		add("connect_timeout", fmt.Sprint(int(cfg.ConnectTimeout.Seconds())))
	}
	if tsa := targetSessionAttrs(cfg.ValidateConnect); tsa != "" {
		add("target_session_attrs", tsa)
	}
	if cfg.ChannelBinding != "" && cfg.ChannelBinding != "prefer" {
		add("channel_binding", cfg.ChannelBinding)
	}
	if cfg.RequireAuth != "" {
		add("require_auth", cfg.RequireAuth)
	}
	if cfg.KerberosSrvName != "" {
		add("krbsrvname", cfg.KerberosSrvName)
	}
	if cfg.KerberosSpn != "" {
		add("krbspn", cfg.KerberosSpn)
	}
	if cfg.MinProtocolVersion != "" && cfg.MinProtocolVersion != "3.0" {
		add("min_protocol_version", cfg.MinProtocolVersion)
	}
	if v := cfg.MaxProtocolVersion; v != "" && v != "3.0" && !(v == "latest" && cfg.MinProtocolVersion != "3.0") {
		add("max_protocol_version", v)
	}
	// Runtime parameters are what pgx does not know (application_name, search_path, pgx's and
	// pgxpool's own): none of them is a secret to pgx, and Postgres gets them as they are.
	for _, k := range slices.Sorted(maps.Keys(cfg.RuntimeParams)) {
		add(k, cfg.RuntimeParams[k])
	}
	return strings.Join(pairs, " ")
}

// sslMode names the sslmode that made the TLS attempts pgx makes to one host.
func sslMode(attempts []*tls.Config) string {
	switch {
	case len(attempts) == 2 && attempts[0] == nil:
		return "allow"
	case len(attempts) == 2:
		return "prefer"
	case len(attempts) != 1:
		return ""
	case attempts[0] == nil:
		return "disable"
	case !attempts[0].InsecureSkipVerify:
		return "verify-full"
	case attempts[0].VerifyPeerCertificate != nil:
		return "verify-ca"
	}
	return "require"
}

// targetSessionAttrs names the target_session_attrs that chose f.
func targetSessionAttrs(f pgconn.ValidateConnectFunc) string {
	if f == nil {
		return ""
	}
	p := reflect.ValueOf(f).Pointer()
	for name, g := range map[string]pgconn.ValidateConnectFunc{
		"read-write":     pgconn.ValidateConnectTargetSessionAttrsReadWrite,
		"read-only":      pgconn.ValidateConnectTargetSessionAttrsReadOnly,
		"primary":        pgconn.ValidateConnectTargetSessionAttrsPrimary,
		"standby":        pgconn.ValidateConnectTargetSessionAttrsStandby,
		"prefer-standby": pgconn.ValidateConnectTargetSessionAttrsPreferStandby,
	} {
		if reflect.ValueOf(g).Pointer() == p {
			return name
		}
	}
	return "(a function)"
}

// kvQuote writes v as a value of a key=value connection string: quoted when it is empty or has
// a space, a quote or a backslash, which are escaped.
func kvQuote(v string) string {
	if v != "" && !strings.ContainsAny(v, " \t\n\r\v\f'\\") {
		return v
	}
	return "'" + strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(v) + "'"
}

// quotedText is a quoted span of an error message: where pgx and strconv put the text at fault.
var quotedText = regexp.MustCompile("\"(?:[^\"\\\\]|\\\\.)*\"|'(?:[^'\\\\]|\\\\.)*'|`[^`]*`")

// connKeywords are the parameter names pgx, pgx.ConnConfig and pgxpool know: words of a
// connection string that pgx's messages use too.
var connKeywords = map[string]bool{}

func init() {
	for _, k := range strings.Fields(`postgres postgresql host port database dbname user password passfile connect_timeout
		sslmode sslkey sslcert sslcertmode sslrootcert sslnegotiation sslpassword sslsni krbspn krbsrvname
		target_session_attrs service servicefile min_protocol_version max_protocol_version channel_binding require_auth
		statement_cache_capacity description_cache_capacity default_query_exec_mode pool_max_conns pool_min_conns
		pool_min_idle_conns pool_max_conn_lifetime pool_max_conn_idle_time pool_health_check_period
		pool_max_conn_lifetime_jitter`) {
		connKeywords[k] = true
	}
}

// dsnError returns the text of err, pgx's refusal of dsn, with nothing of dsn in it. pgx quotes
// the whole string in its errors with only the passwords it recognizes masked (best effort, as
// its documentation warns: a malformed string is ambiguous), and its reasons quote the text at
// fault, which in a malformed string can be a piece of a password (password=two words: pgx
// complains about the key "words"). So the string is left out, every quoted span is cut, and any
// word of dsn that is still there is too.
func dsnError(dsn string, err error) string {
	msg := err.Error()
	if pce, ok := errors.AsType[*pgconn.ParseConfigError](err); ok {
		c := *pce
		c.ConnString = ""
		msg = strings.TrimPrefix(c.Error(), "cannot parse ``: ")
	}
	msg = quotedText.ReplaceAllString(msg, "…")
	words := strings.FieldsFunc(dsn, func(r rune) bool { return strings.ContainsRune(" \t\n\r=:@/?&,;#'\"\\[]", r) })
	slices.SortFunc(words, func(a, b string) int { return len(b) - len(a) })
	for _, w := range words {
		if len(w) >= 3 && !connKeywords[strings.ToLower(w)] {
			msg = strings.ReplaceAll(msg, w, "…")
		}
	}
	return msg
}

// topicShown returns topic's settings in force, and where each came from.
func (e *env) topicShown(hs *registry, topic string) topicSettingsShown {
	tp, _ := e.topicPolicy(hs, topic)
	te := e.topics[topic]
	name := cmp.Or(te.handler, e.Handler)
	ts := topicSettingsShown{Topic: topic, Handler: name, DLQTopic: retrytopics.DLQTopic(topic, e.KafkaGroupID), From: map[string]string{}}
	switch {
	case te.handler != "":
		ts.From["handler"] = te.vars["Handler"]
	case os.Getenv("HANDLER") != "":
		ts.From["handler"] = "HANDLER"
	default:
		ts.From["handler"] = "the binary's only handler"
	}
	if h := hs.get(name); h != nil {
		ts.HandlerType = fmt.Sprintf("%T", h.Handler)
	}
	// from says where field got its value: its source of the topic, else the service-wide
	// variable (set or default).
	from := func(key, field, variable string) {
		if src := e.settingSource(hs, topic, field); src != "" {
			ts.From[key] = src
			return
		}
		if _, ok := os.LookupEnv(variable); ok {
			ts.From[key] = variable
			return
		}
		ts.From[key] = variable + " (default)"
	}
	tiers := e.tiers
	if tp.RetryTiers != nil {
		tiers = tp.RetryTiers
	}
	ts.RetryTiers = []string{}
	ts.TierTopics = []string{}
	for i, d := range tiers {
		ts.RetryTiers = append(ts.RetryTiers, d.String())
		ts.TierTopics = append(ts.TierTopics, fmt.Sprintf("%s (due %s after the failure, with jitter)", retrytopics.TierTopic(topic, e.KafkaGroupID, i+1), d))
	}
	from("retry_tiers", "RetryTiers", "RETRY_TIERS")
	ts.LocalAttempts = cmp.Or(tp.LocalAttempts, e.RetryLocalAttempts)
	from("local_attempts", "LocalAttempts", "RETRY_LOCAL_ATTEMPTS")
	ts.OnDeadLetter = string(cmp.Or(tp.OnDeadLetter, processor.OnDeadLetter(e.OnDeadLetter)))
	from("on_dead_letter", "OnDeadLetter", "ON_DEAD_LETTER")
	ts.MaxRecordBytes = cmp.Or(tp.MaxRecordBytes, e.MaxRecordBytes)
	from("max_record_bytes", "MaxRecordBytes", "MAX_RECORD_BYTES")
	ts.Concurrency = cmp.Or(tp.Concurrency, e.Concurrency)
	from("concurrency", "Concurrency", "CONCURRENCY")
	switch src := e.settingSource(hs, topic, "IdempotencyKey"); {
	case tp.IdempotencyKey == nil && src == "":
		ts.IdempotencyKey = "none"
	case tp.IdempotencyKey == nil:
		ts.IdempotencyKey = "none"
		ts.From["idempotency_key"] = src
	case te.idempotencyKeySet:
		ts.IdempotencyKey = strings.TrimSpace(os.Getenv(src))
		ts.From["idempotency_key"] = src
	default: // the handler's Go field: named as it was built, a function of the user's never called
		ts.IdempotencyKey = tp.IdempotencyKey.String()
		ts.From["idempotency_key"] = src
	}
	values, keys := e.formats(hs, topic)
	ts.ValueFormat, ts.KeyFormat = "none", "none"
	if values != nil {
		ts.ValueFormat = values.String() + " (the Schema Registry's wire format)"
	}
	if keys != nil {
		ts.KeyFormat = keys.String() + " (the Schema Registry's wire format)"
	}
	if src := e.settingSource(hs, topic, "Values"); src != "" {
		ts.From["value_format"] = src
	}
	if src := e.settingSource(hs, topic, "Keys"); src != "" {
		ts.From["key_format"] = src
	}
	return ts
}
