package service

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"io"
	"log/slog"
	"math/big"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/console"
	"github.com/kafkapg/kafkapg/internal/ops"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
)

// Tests of what docs/configuration.md promises about single variables.

// TestOperatorTokenOfAtLeast16Characters: a shorter OPERATOR_TOKEN stops the service with status 2
// and a message naming it; 16 characters are enough.
func TestOperatorTokenOfAtLeast16Characters(t *testing.T) {
	for _, token := range []string{"0123456789abcde", "  0123456789abcde  "} {
		// A DATABASE_URL that openPool refuses: were the token accepted, Run would stop there
		// (with another message) instead of running.
		setEnv(t, with("OPERATOR_TOKEN", token, "DATABASE_URL", "postgres://%zz"))
		var out bytes.Buffer
		if code := Run([]string{"run"}, &out, builtinHandlers...); code != 2 {
			t.Errorf("OPERATOR_TOKEN=%q (15 characters): Run = %d, want 2; output:\n%s", token, code, out.String())
		}
		if !strings.Contains(out.String(), "configuration error: OPERATOR_TOKEN must be at least 16 characters") {
			t.Errorf("OPERATOR_TOKEN=%q: output does not name OPERATOR_TOKEN and its length:\n%s", token, out.String())
		}
		if strings.Contains(out.String(), strings.TrimSpace(token)) {
			t.Errorf("the output quotes the token:\n%s", out.String())
		}
	}
	setEnv(t, with("OPERATOR_TOKEN", "0123456789abcdef"))
	e, err := loadEnv(builtins())
	if err != nil {
		t.Fatalf("OPERATOR_TOKEN of 16 characters: %v", err)
	}
	if e.OperatorToken != "0123456789abcdef" {
		t.Fatalf("OperatorToken = %q", e.OperatorToken)
	}
}

// TestConsoleSampleIntervalBounds: CONSOLE_SAMPLE_INTERVAL is 1s to 5m, both included.
func TestConsoleSampleIntervalBounds(t *testing.T) {
	for _, tt := range []struct {
		value string
		ok    bool
	}{
		{"1s", true}, {"5m", true}, {"300s", true},
		{"999ms", false}, {"5m1s", false}, {"0s", false}, {"-1m", false},
	} {
		setEnv(t, with("CONSOLE_SAMPLE_INTERVAL", tt.value))
		e, err := loadEnv(builtins())
		switch {
		case tt.ok && err != nil:
			t.Errorf("CONSOLE_SAMPLE_INTERVAL=%s: %v, want it accepted", tt.value, err)
		case tt.ok:
			if want, _ := time.ParseDuration(tt.value); e.ConsoleSampleEvery != want {
				t.Errorf("CONSOLE_SAMPLE_INTERVAL=%s: read as %v", tt.value, e.ConsoleSampleEvery)
			}
		case err == nil:
			t.Errorf("CONSOLE_SAMPLE_INTERVAL=%s accepted, want it refused", tt.value)
		case !strings.Contains(err.Error(), "CONSOLE_SAMPLE_INTERVAL=") || !strings.Contains(err.Error(), "want 1s to 5m"):
			t.Errorf("CONSOLE_SAMPLE_INTERVAL=%s: error %q does not name the variable and its range", tt.value, err)
		}
	}
}

// TestPoolMaxConnsFromTheURL: pool_max_conns in DATABASE_URL sizes the pool; without it,
// DB_MAX_CONNS does.
func TestPoolMaxConnsFromTheURL(t *testing.T) {
	for _, tt := range []struct {
		name, url, maxConns string
		want                int32
	}{
		{"URL with pool_max_conns", "postgres://kafkapg@127.0.0.1:1/kafkapg?sslmode=disable&pool_max_conns=3", "7", 3},
		{"keyword/value with pool_max_conns", "host=127.0.0.1 port=1 user=kafkapg dbname=kafkapg pool_max_conns=4", "7", 4},
		{"URL without", "postgres://kafkapg@127.0.0.1:1/kafkapg?sslmode=disable", "7", 7},
		{"URL without, DB_MAX_CONNS's default", "postgres://kafkapg@127.0.0.1:1/kafkapg?sslmode=disable", "", 10},
	} {
		t.Run(tt.name, func(t *testing.T) {
			vars := map[string]string{"DATABASE_URL": tt.url}
			if tt.maxConns != "" {
				vars["DB_MAX_CONNS"] = tt.maxConns
			}
			setEnv(t, vars)
			e, err := loadDBEnv()
			if err != nil {
				t.Fatal(err)
			}
			pool, _, err := openPool(context.Background(), e) // connects nowhere
			if err != nil {
				t.Fatal(err)
			}
			defer pool.Close()
			if got := pool.Config().MaxConns; got != tt.want {
				t.Errorf("the pool's MaxConns = %d, want %d", got, tt.want)
			}
		})
	}
}

// TestConsoleLoginEntries: CONSOLE_USERS and CONSOLE_TOKENS are comma-separated entries, each trimmed;
// a secret may hold colons but no comma, and an entry a comma split is refused with a message
// that says so, naming the variable and the entry, never the secret.
func TestConsoleLoginEntries(t *testing.T) {
	t.Run("accepted", func(t *testing.T) {
		setEnv(t, with("CONSOLE_ADDR", "127.0.0.1:0",
			"CONSOLE_USERS", "  ann:viewer:pass:word:with:colons , bob:operator:bob-password-1  ,",
			"CONSOLE_TOKENS", " bot:operator:token:with:colons-16 "))
		e, err := loadEnv(builtins())
		if err != nil {
			t.Fatal(err)
		}
		users, tokens, err := e.consoleLogins()
		if err != nil {
			t.Fatal(err)
		}
		wantUsers := []console.User{
			{Name: "ann", Role: console.Viewer, Password: "pass:word:with:colons"},
			{Name: "bob", Role: console.Operator, Password: "bob-password-1"},
		}
		if !equalUsers(users, wantUsers) {
			t.Errorf("users = %+v, want %+v", users, wantUsers)
		}
		wantTokens := []console.User{{Name: "bot", Role: console.Operator, Password: "token:with:colons-16"}}
		if !equalUsers(tokens, wantTokens) {
			t.Errorf("tokens = %+v, want %+v", tokens, wantTokens)
		}
	})
	for _, tt := range []struct {
		name, variable, value string
		secrets               []string // must not appear in the error
		want                  string
	}{
		{name: "a password with a comma", variable: "CONSOLE_USERS", value: "ann:viewer:first-half,second-half-of-it",
			secrets: []string{"first-half", "second-half"},
			want:    "CONSOLE_USERS: entry 2: want name:role:password (entries are separated by commas, so a password cannot contain one)"},
		// The first half is also too short a password: the split, not the length, is the problem.
		{name: "a short half before the comma", variable: "CONSOLE_USERS", value: "bob:operator:bob-password-1, ann:viewer:short,rest-of:it",
			secrets: []string{"short", "rest-of"},
			want:    "CONSOLE_USERS: entry 3: want name:role:password (entries are separated by commas"},
		{name: "a piece after the comma that looks like name:role:", variable: "CONSOLE_USERS", value: "ann:viewer:first-half-long,x:y:z",
			secrets: []string{"first-half"},
			want:    "CONSOLE_USERS: entry 2: its second field, the role, must be viewer or operator (want name:role:password); entries are separated by commas, so a password cannot contain one"},
		{name: "a token with a comma", variable: "CONSOLE_TOKENS", value: "bot:operator:0123456789,abcdef",
			secrets: []string{"0123456789", "abcdef"},
			want:    "CONSOLE_TOKENS: entry 2: want name:role:token (entries are separated by commas, so a token cannot contain one)"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			setEnv(t, with("CONSOLE_ADDR", "127.0.0.1:0", tt.variable, tt.value))
			_, err := loadEnv(builtins())
			if err == nil {
				t.Fatalf("%s=%q accepted", tt.variable, tt.value)
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Errorf("error %q\ndoes not contain %q", err, tt.want)
			}
			for _, s := range tt.secrets {
				if strings.Contains(err.Error(), s) {
					t.Errorf("error %q quotes the secret's %q", err, s)
				}
			}
		})
	}
}

// TestConsoleLoginSpacesAsDocumented: only an entry of CONSOLE_USERS or CONSOLE_TOKENS is trimmed,
// not its fields: spaces at a secret's start are part of it, those at its end go with the
// entry's, and a space after a colon puts the role out. docs/configuration.md's rows say so.
func TestConsoleLoginSpacesAsDocumented(t *testing.T) {
	b, err := os.ReadFile("../docs/configuration.md")
	if err != nil {
		t.Fatal(err)
	}
	rows := map[string]string{}
	for _, line := range strings.Split(string(b), "\n") {
		for _, v := range []string{"CONSOLE_USERS", "CONSOLE_TOKENS"} {
			if strings.HasPrefix(line, "| `"+v+"` |") {
				rows[v] = line
			}
		}
	}
	secretSpaces := "spaces at its start are part of it, spaces at its end are trimmed away with the entry's"
	for _, c := range []struct{ variable, phrase string }{
		{"CONSOLE_USERS", "Each entry is trimmed of surrounding spaces, and nothing inside it is: the name and the role are read as written between the colons"},
		{"CONSOLE_USERS", secretSpaces},
		{"CONSOLE_TOKENS", secretSpaces},
	} {
		if !strings.Contains(rows[c.variable], c.phrase) {
			t.Errorf("docs/configuration.md's %s row does not say %q", c.variable, c.phrase)
		}
	}

	setEnv(t, with("CONSOLE_ADDR", "127.0.0.1:0",
		"CONSOLE_USERS", " ann:viewer:  spaced password  ",
		"CONSOLE_TOKENS", "bot:operator: a token with spaces "))
	e, err := loadEnv(builtins())
	if err != nil {
		t.Fatal(err)
	}
	users, tokens, err := e.consoleLogins()
	if err != nil {
		t.Fatal(err)
	}
	if want := []console.User{{Name: "ann", Role: console.Viewer, Password: "  spaced password"}}; !equalUsers(users, want) {
		t.Errorf("users = %+v, want %+v (the start's spaces kept, the end's trimmed)", users, want)
	}
	if want := []console.User{{Name: "bot", Role: console.Operator, Password: " a token with spaces"}}; !equalUsers(tokens, want) {
		t.Errorf("tokens = %+v, want %+v (the start's spaces kept, the end's trimmed)", tokens, want)
	}
	setEnv(t, with("CONSOLE_ADDR", "127.0.0.1:0", "CONSOLE_USERS", "ann: viewer:long-enough-password"))
	if _, err := loadEnv(builtins()); err == nil || !strings.Contains(err.Error(), "the role, must be viewer or operator") {
		t.Errorf("a space after the first colon: %v; want the role refused (fields are not trimmed)", err)
	}
}

func equalUsers(a, b []console.User) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// TestPprofOnItsOwnListener: with PPROF_ADDR, Go's profiles are served there, and not on
// HTTP_ADDR nor CONSOLE_ADDR; without it, on none of them. It checks the listeners the service
// opens, since importing net/http/pprof also registers the profiles on http.DefaultServeMux.
func TestPprofOnItsOwnListener(t *testing.T) {
	_, dbURL := testenv.Postgres(t)
	k := testenv.NewKfake(t)
	topic := k.CreateTopic(t, 1)
	const user, password = "ann", "ann-password-1"
	// pprofAt reports whether GET addr/debug/pprof/ answers with the profiles' index.
	pprofAt := func(addr string) (bool, error) {
		req, err := http.NewRequest("GET", "http://"+addr+"/debug/pprof/", nil)
		if err != nil {
			return false, err
		}
		req.SetBasicAuth(user, password) // the console's: past its login, to what it serves
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return false, err
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		return resp.StatusCode == http.StatusOK && strings.Contains(string(body), "goroutine"), err
	}
	start := func(pprofAddr string) (svc *service, consoleAddr string) {
		consoleAddr = testenv.FreeAddr(t)
		vars := map[string]string{
			"DATABASE_URL": dbURL, "KAFKA_BROKERS": k.Brokers[0], "KAFKA_TOPICS": topic,
			"CONSOLE_ADDR": consoleAddr, "CONSOLE_USERS": user + ":viewer:" + password,
		}
		if pprofAddr != "" {
			vars["PPROF_ADDR"] = pprofAddr
		}
		svc = startService(t, vars)
		svc.waitReady() // every listener is open
		return svc, consoleAddr
	}

	pprofAddr := testenv.FreeAddr(t)
	svc, consoleAddr := start(pprofAddr)
	if ok, err := pprofAt(pprofAddr); err != nil || !ok {
		t.Errorf("PPROF_ADDR=%s does not serve /debug/pprof/ (%v)", pprofAddr, err)
	}
	for name, addr := range map[string]string{"HTTP_ADDR": svc.httpAddr, "CONSOLE_ADDR": consoleAddr} {
		if ok, err := pprofAt(addr); err != nil || ok {
			t.Errorf("%s serves /debug/pprof/ (%v): it must only be on PPROF_ADDR", name, err)
		}
	}
	svc.stop()
	if _, err := pprofAt(pprofAddr); err == nil {
		t.Error("PPROF_ADDR still answers after the service stopped")
	}

	svc, consoleAddr = start("")
	for name, addr := range map[string]string{"HTTP_ADDR": svc.httpAddr, "CONSOLE_ADDR": consoleAddr} {
		if ok, err := pprofAt(addr); err != nil || ok {
			t.Errorf("without PPROF_ADDR, %s serves /debug/pprof/ (%v)", name, err)
		}
	}
	if strings.Contains(svc.logs.String(), "pprof listening") {
		t.Errorf("without PPROF_ADDR, the service says it serves pprof:\n%s", svc.logs.String())
	}
	svc.stop()
}

// TestKafkaTLSServerName: KAFKA_TLS_SERVER_NAME is the name the brokers' certificates are
// verified against: a broker at 127.0.0.1 whose certificate is for kafka.test only is trusted
// with KAFKA_TLS_SERVER_NAME=kafka.test, and not without it (nor with another name).
func TestKafkaTLSServerName(t *testing.T) {
	dir := t.TempDir()
	ca, caKey := issue(t, &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "kafkapg test CA"},
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}, nil, nil)
	srv, srvKey := issue(t, &x509.Certificate{
		SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "kafka.test"}, DNSNames: []string{"kafka.test"},
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}, ca, caKey)
	caFile := writePEM(t, filepath.Join(dir, "ca.pem"), "CERTIFICATE", ca.Raw)
	k := testenv.NewKfake(t, kfake.TLS(&tls.Config{
		Certificates: []tls.Certificate{{Certificate: [][]byte{srv.Raw}, PrivateKey: srvKey}}, MinVersion: tls.VersionTLS12,
	}))
	if !strings.HasPrefix(k.Brokers[0], "127.0.0.1:") {
		t.Fatalf("kfake listens on %s, want 127.0.0.1: the test dials an address the certificate does not name", k.Brokers[0])
	}

	for _, tt := range []struct {
		serverName string
		wantErr    string // "" for a handshake that succeeds
	}{
		{serverName: "kafka.test"},
		{serverName: "", wantErr: "x509: cannot validate certificate for 127.0.0.1"},
		{serverName: "other.test", wantErr: "certificate is valid for kafka.test, not other.test"},
	} {
		setEnv(t, with("KAFKA_BROKERS", k.Brokers[0], "KAFKA_TLS_CA_FILE", caFile, "KAFKA_TLS_SERVER_NAME", tt.serverName))
		e, err := loadEnv(builtins())
		if err != nil {
			t.Fatal(err)
		}
		cfg, err := e.tlsConfig()
		if err != nil {
			t.Fatal(err)
		}
		if cfg.ServerName != tt.serverName {
			t.Errorf("KAFKA_TLS_SERVER_NAME=%q: tls.Config.ServerName = %q", tt.serverName, cfg.ServerName)
		}
		// The client the processor makes: the brokers and the options the environment gives.
		cl, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(e.KafkaBrokers...)}, e.kafkaOpts...)...)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		err = cl.Ping(ctx)
		cancel()
		cl.Close()
		switch {
		case tt.wantErr == "" && err != nil:
			t.Errorf("KAFKA_TLS_SERVER_NAME=%q: %v, want the handshake to succeed", tt.serverName, err)
		case tt.wantErr != "" && err == nil:
			t.Errorf("KAFKA_TLS_SERVER_NAME=%q: connected, want the certificate refused", tt.serverName)
		case tt.wantErr != "" && !strings.Contains(err.Error(), tt.wantErr):
			t.Errorf("KAFKA_TLS_SERVER_NAME=%q: %v, want %q", tt.serverName, err, tt.wantErr)
		}
	}
}

// TestOperatorTokenFromASecretFile: an OPERATOR_TOKEN that ends in a newline (a Secret written
// from a file) is the token without it, the one a caller can send: its length is checked
// trimmed, and a header's value arrives trimmed.
func TestOperatorTokenFromASecretFile(t *testing.T) {
	pool := dlqDB(t)
	ctx, cancel := context.WithCancel(context.Background())
	const token = "0123456789abcdef-token"
	a := newAPI(ctx, ops.New(pool, "kafkapg", "dg"), token+"\n", nil, slog.New(slog.NewTextHandler(io.Discard, nil)))
	srv := httptest.NewServer(a.handler())
	defer srv.Close()
	defer func() { cancel(); a.wait() }()
	for tok, want := range map[string]int{token: http.StatusOK, "wrong-token-0123456789": http.StatusUnauthorized} {
		req, err := http.NewRequest("GET", srv.URL+"/api/v1/tasks", nil)
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Authorization", "Bearer "+tok)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != want {
			t.Errorf("OPERATOR_TOKEN %q + newline, called with %q: %d, want %d", token, tok, resp.StatusCode, want)
		}
	}
}
