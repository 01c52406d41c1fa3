package service

import (
	"cmp"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/url"
	"os"
	"reflect"
	"regexp"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/kafkapg/kafkapg/internal/console"
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
	if *asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(shown)
	}
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

// passwordParam is a password in a key=value connection string.
var passwordParam = regexp.MustCompile(`(?i)(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)`)

// redact returns value, the value of variable name, with any secret in it replaced.
func redact(name, value string) string {
	if value == "" {
		return ""
	}
	switch name {
	case "OPERATOR_TOKEN", "KAFKA_SASL_PASSWORD":
		return redacted
	case "CONSOLE_USERS", "CONSOLE_TOKENS":
		parse := console.ParseUsers
		if name == "CONSOLE_TOKENS" {
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
		return redactDSN(value)
	}
	return value
}

// redactDSN returns a connection string (a URL, or key=value pairs) with its passwords replaced.
func redactDSN(dsn string) string {
	if u, err := url.Parse(dsn); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
		if _, ok := u.User.Password(); ok {
			u.User = url.UserPassword(u.User.Username(), redacted)
		}
		q := u.Query()
		if q.Has("password") {
			q.Set("password", redacted)
			u.RawQuery = q.Encode()
		}
		s := u.String()
		return strings.Replace(s, url.QueryEscape(redacted), redacted, -1)
	}
	return passwordParam.ReplaceAllString(dsn, "${1}"+redacted)
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
	default:
		ts.IdempotencyKey = "a Go function"
		ts.From["idempotency_key"] = src
	}
	return ts
}
