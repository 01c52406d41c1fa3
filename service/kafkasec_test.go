package service

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/sasl/plain"
	"github.com/twmb/franz-go/pkg/sasl/scram"

	"github.com/kafkapg/kafkapg/internal/kafkalogin"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
)

const (
	saslUser     = "kafkapg"
	saslPassword = "correct-horse-battery-staple"
)

// saslKfake starts a kfake cluster that requires SASL with mechanism, with the test's own
// clients authenticated; extra options (TLS) are added to the cluster and the clients.
func saslKfake(t *testing.T, mechanism string, cluster []kfake.Opt, client []kgo.Opt) *testenv.Kafka {
	t.Helper()
	k := testenv.NewKfake(t, append([]kfake.Opt{kfake.EnableSASL(), kfake.Superuser(mechanism, saslUser, saslPassword)}, cluster...)...)
	var mech kgo.Opt
	switch mechanism {
	case "PLAIN":
		mech = kgo.SASL(plain.Auth{User: saslUser, Pass: saslPassword}.AsMechanism())
	case "SCRAM-SHA-256":
		mech = kgo.SASL(scram.Auth{User: saslUser, Pass: saslPassword}.AsSha256Mechanism())
	case "SCRAM-SHA-512":
		mech = kgo.SASL(scram.Auth{User: saslUser, Pass: saslPassword}.AsSha512Mechanism())
	}
	k.ClientOpts = append([]kgo.Opt{mech}, client...)
	return k
}

// TestKafkaSASL runs the service against a broker that requires each SASL mechanism: with the
// right credentials it processes records; with a wrong password it waits, says why on /readyz,
// and never logs or shows the password.
func TestKafkaSASL(t *testing.T) {
	for _, mech := range kafkalogin.Mechanisms {
		t.Run(mech, func(t *testing.T) {
			pool, dbURL := testenv.Postgres(t)
			k := saslKfake(t, mech, nil, nil)
			topic := k.CreateTopic(t, 2)
			svc := startService(t, map[string]string{
				"DATABASE_URL":         dbURL,
				"KAFKA_BROKERS":        k.Brokers[0],
				"KAFKA_TOPICS":         topic,
				"KAFKA_SASL_MECHANISM": mech,
				"KAFKA_SASL_USERNAME":  saslUser,
				"KAFKA_SASL_PASSWORD":  saslPassword,
			})
			svc.waitReady()
			svc.applyOne(pool, k, topic)
			svc.stop()
			if strings.Contains(svc.logs.String(), saslPassword) {
				t.Errorf("the logs contain the SASL password:\n%s", svc.logs.String())
			}
		})
	}
	t.Run("wrong password", func(t *testing.T) {
		_, dbURL := testenv.Postgres(t)
		k := saslKfake(t, "SCRAM-SHA-256", nil, nil)
		topic := k.CreateTopic(t, 1)
		const wrong = "not-the-password-123"
		svc := startService(t, map[string]string{
			"DATABASE_URL":         dbURL,
			"KAFKA_BROKERS":        k.Brokers[0],
			"KAFKA_TOPICS":         topic,
			"KAFKA_SASL_MECHANISM": "SCRAM-SHA-256",
			"KAFKA_SASL_USERNAME":  saslUser,
			"KAFKA_SASL_PASSWORD":  wrong,
		})
		svc.waitNotReady("not ready: kafka")
		testenv.Eventually(t, 20*time.Second, func() error { // the login refused, and logged
			if !strings.Contains(svc.logs.String(), "cannot check the topics on kafka yet") {
				return errors.New("the logs do not say it waits for kafka:\n" + svc.logs.String())
			}
			return nil
		})
		_, body, _ := get("http://" + svc.httpAddr + "/readyz")
		t.Logf("/readyz: %s", strings.TrimSpace(body))
		svc.stop()
		for what, text := range map[string]string{"logs": svc.logs.String(), "/readyz": body} {
			if strings.Contains(text, wrong) {
				t.Errorf("the %s contain the SASL password:\n%s", what, text)
			}
		}
	})
}

// TestKafkaTLS runs the service against a broker that requires TLS (with a CA made for the test)
// and SASL on top.
func TestKafkaTLS(t *testing.T) {
	pool, dbURL := testenv.Postgres(t)
	dir := t.TempDir()
	serverCfg, caFile := testCA(t, dir)
	clientTLS := &tls.Config{RootCAs: x509.NewCertPool(), MinVersion: tls.VersionTLS12}
	caPEM, err := os.ReadFile(caFile)
	if err != nil {
		t.Fatal(err)
	}
	clientTLS.RootCAs.AppendCertsFromPEM(caPEM)
	k := saslKfake(t, "SCRAM-SHA-512", []kfake.Opt{kfake.TLS(serverCfg)}, []kgo.Opt{kgo.DialTLSConfig(clientTLS)})
	topic := k.CreateTopic(t, 2)

	svc := startService(t, map[string]string{
		"DATABASE_URL":         dbURL,
		"KAFKA_BROKERS":        k.Brokers[0],
		"KAFKA_TOPICS":         topic,
		"KAFKA_TLS_CA_FILE":    caFile,
		"KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
		"KAFKA_SASL_USERNAME":  saslUser,
		"KAFKA_SASL_PASSWORD":  saslPassword,
	})
	svc.waitReady()
	svc.applyOne(pool, k, topic)
	svc.stop()

	// Without the CA the broker's certificate is not trusted: the service waits and says so.
	svc = startService(t, map[string]string{
		"DATABASE_URL":         dbURL,
		"KAFKA_BROKERS":        k.Brokers[0],
		"KAFKA_TOPICS":         topic,
		"KAFKA_TLS":            "true",
		"KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
		"KAFKA_SASL_USERNAME":  saslUser,
		"KAFKA_SASL_PASSWORD":  saslPassword,
	})
	svc.waitNotReady("not ready: kafka")
	testenv.Eventually(t, 20*time.Second, func() error { // the detail is in the log, not on /readyz
		if !strings.Contains(svc.logs.String(), "certificate") {
			return errors.New("the logs do not say the broker's certificate is not trusted:\n" + svc.logs.String())
		}
		return nil
	})
	svc.stop()
}

// testCA makes a CA and a server certificate for 127.0.0.1 signed by it; it returns the
// server's TLS config and the CA's PEM file.
func testCA(t *testing.T, dir string) (*tls.Config, string) {
	cfg, caFile, _, _ := testPKI(t, dir)
	return cfg, caFile
}

// testPKI is testCA that also returns the CA, to issue client certificates with.
func testPKI(t *testing.T, dir string) (*tls.Config, string, *x509.Certificate, *ecdsa.PrivateKey) {
	t.Helper()
	ca, caKey := issue(t, &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "kafkapg test CA"},
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}, nil, nil)
	srv, srvKey := issue(t, &x509.Certificate{
		SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "127.0.0.1"},
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")},
		KeyUsage:    x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}, ca, caKey)
	caFile := writePEM(t, filepath.Join(dir, "ca.pem"), "CERTIFICATE", ca.Raw)
	return &tls.Config{Certificates: []tls.Certificate{{Certificate: [][]byte{srv.Raw}, PrivateKey: srvKey}}, MinVersion: tls.VersionTLS12}, caFile, ca, caKey
}

// issue makes a key and a certificate from tmpl, valid for an hour either side of now, signed by
// parent (self-signed if parent is nil).
func issue(t *testing.T, tmpl *x509.Certificate, parent *x509.Certificate, parentKey *ecdsa.PrivateKey) (*x509.Certificate, *ecdsa.PrivateKey) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl.NotBefore, tmpl.NotAfter = time.Now().Add(-time.Hour), time.Now().Add(time.Hour)
	if parent == nil {
		parent, parentKey = tmpl, key
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, &key.PublicKey, parentKey)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return cert, key
}

// writePEM writes one PEM block to path and returns path.
func writePEM(t *testing.T, path, typ string, der []byte) string {
	t.Helper()
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// clientCert issues a client certificate signed by the CA and writes it and its key as PEM
// files; it returns their paths and the certificate for the test's own clients.
func clientCert(t *testing.T, dir string, ca *x509.Certificate, caKey *ecdsa.PrivateKey) (certFile, keyFile string, cert tls.Certificate) {
	t.Helper()
	c, key := issue(t, &x509.Certificate{
		SerialNumber: big.NewInt(3), Subject: pkix.Name{CommonName: "kafkapg"},
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}, ca, caKey)
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	certFile = writePEM(t, filepath.Join(dir, "client.pem"), "CERTIFICATE", c.Raw)
	keyFile = writePEM(t, filepath.Join(dir, "client-key.pem"), "EC PRIVATE KEY", keyDER)
	return certFile, keyFile, tls.Certificate{Certificate: [][]byte{c.Raw}, PrivateKey: key}
}

// TestKafkaMutualTLS: a broker that requires client certificates accepts the service with
// KAFKA_TLS_CERT_FILE/KEY_FILE, and refuses it without (the service waits and says so).
func TestKafkaMutualTLS(t *testing.T) {
	pool, dbURL := testenv.Postgres(t)
	dir := t.TempDir()
	serverCfg, caFile, ca, caKey := testPKI(t, dir)
	serverCfg.ClientAuth = tls.RequireAndVerifyClientCert
	serverCfg.ClientCAs = x509.NewCertPool()
	serverCfg.ClientCAs.AddCert(ca)
	certFile, keyFile, cert := clientCert(t, dir, ca, caKey)
	clientTLS := &tls.Config{RootCAs: x509.NewCertPool(), Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	clientTLS.RootCAs.AddCert(ca)
	k := testenv.NewKfake(t, kfake.TLS(serverCfg))
	k.ClientOpts = []kgo.Opt{kgo.DialTLSConfig(clientTLS)}
	topic := k.CreateTopic(t, 1)

	svc := startService(t, map[string]string{
		"DATABASE_URL":        dbURL,
		"KAFKA_BROKERS":       k.Brokers[0],
		"KAFKA_TOPICS":        topic,
		"KAFKA_TLS_CA_FILE":   caFile,
		"KAFKA_TLS_CERT_FILE": certFile,
		"KAFKA_TLS_KEY_FILE":  keyFile,
	})
	svc.waitReady()
	svc.applyOne(pool, k, topic)
	svc.stop()

	svc = startService(t, map[string]string{
		"DATABASE_URL":      dbURL,
		"KAFKA_BROKERS":     k.Brokers[0],
		"KAFKA_TOPICS":      topic,
		"KAFKA_TLS_CA_FILE": caFile,
	})
	svc.waitNotReady("not ready: kafka")
	svc.stop()
}
