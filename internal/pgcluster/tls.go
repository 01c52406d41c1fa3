package pgcluster

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// TLS names the files of a server certificate: PEM files the server's user can read.
type TLS struct {
	CAFile   string // the CA that signed CertFile: what a client passes as sslrootcert
	CertFile string // the server's certificate
	KeyFile  string // its private key, mode 0600, owned by the server's user
}

// NewTLS creates, in dir, a fresh CA (ca.crt) and a server certificate signed by it
// (server.crt, server.key; ECDSA P-256, valid for a year) for hosts: DNS names and IP
// addresses, "localhost" and "127.0.0.1" if none are given. dir is created if needed and must
// be reachable by the postgres user (not t.TempDir() when root: use a dir under /tmp). The
// CA's key is not kept: nothing else can be signed by it.
func NewTLS(dir string, hosts ...string) (*TLS, error) {
	if len(hosts) == 0 {
		hosts = []string{"localhost", "127.0.0.1"}
	}
	acct, err := serverAccount()
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("pgcluster: NewTLS: %w", err)
	}
	if err := acct.checkReachable(filepath.Join(dir, "server.key")); err != nil {
		return nil, fmt.Errorf("pgcluster: NewTLS: %w", err)
	}
	now := time.Now()

	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	caTmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: "pgcluster test CA " + now.UTC().Format(time.RFC3339Nano)},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.AddDate(1, 0, 0),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return nil, fmt.Errorf("pgcluster: NewTLS: CA certificate: %w", err)
	}
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		return nil, err
	}

	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: hosts[0]},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.AddDate(1, 0, 0),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	for _, h := range hosts {
		if ip := net.ParseIP(h); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, h)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		return nil, fmt.Errorf("pgcluster: NewTLS: server certificate: %w", err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, err
	}

	t := &TLS{
		CAFile:   filepath.Join(dir, "ca.crt"),
		CertFile: filepath.Join(dir, "server.crt"),
		KeyFile:  filepath.Join(dir, "server.key"),
	}
	pemOf := func(typ string, b []byte) []byte { return pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: b}) }
	if err := errors.Join(
		acct.writeFile(t.CAFile, pemOf("CERTIFICATE", caDER), 0o644),
		acct.writeFile(t.CertFile, pemOf("CERTIFICATE", der), 0o644),
		acct.writeFile(t.KeyFile, pemOf("PRIVATE KEY", keyDER), 0o600), // the server refuses a key others can read
	); err != nil {
		return nil, fmt.Errorf("pgcluster: NewTLS: %w", err)
	}
	return t, nil
}

func serial() *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		panic(err) // crypto/rand does not fail on Linux
	}
	return n
}
