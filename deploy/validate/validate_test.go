// Package validate checks kafkapg's deployment files: the kustomize manifests build and every
// resource decodes strictly into its Kubernetes (or Prometheus Operator) type, the pieces agree
// with each other, the alert rules pass Prometheus's rule checks, and the dashboard's queries are
// valid PromQL. It is a module of its own so that kafkapg's users do not inherit these
// dependencies. That the queries only use metrics kafkapg exports is checked against a running
// processor by package service's TestDeployQueriesUseExportedMetrics.
package validate

import (
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	kedav1alpha1 "github.com/kedacore/keda/v2/apis/keda/v1alpha1"
	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/rulefmt"
	"github.com/prometheus/prometheus/promql/parser"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	"sigs.k8s.io/yaml"
)

// manifests is what `kubectl kustomize deploy/kubernetes` renders, decoded.
type manifests struct {
	deployment *appsv1.Deployment
	service    *corev1.Service
	config     *corev1.ConfigMap
	pdb        *policyv1.PodDisruptionBudget
	monitor    *monitoringv1.ServiceMonitor
	rules      *monitoringv1.PrometheusRule
	policy     *networkingv1.NetworkPolicy
}

func build(t *testing.T) manifests {
	t.Helper()
	var m manifests
	decode(t, "../kubernetes", func(kind, name string) any {
		switch kind {
		case "Deployment":
			m.deployment = &appsv1.Deployment{}
			return m.deployment
		case "Service":
			m.service = &corev1.Service{}
			return m.service
		case "ConfigMap":
			m.config = &corev1.ConfigMap{}
			return m.config
		case "PodDisruptionBudget":
			m.pdb = &policyv1.PodDisruptionBudget{}
			return m.pdb
		case "ServiceMonitor":
			m.monitor = &monitoringv1.ServiceMonitor{}
			return m.monitor
		case "PrometheusRule":
			m.rules = &monitoringv1.PrometheusRule{}
			return m.rules
		case "NetworkPolicy":
			m.policy = &networkingv1.NetworkPolicy{}
			return m.policy
		}
		t.Errorf("unexpected resource %s %s", kind, name)
		return nil
	})
	for name, missing := range map[string]bool{"Deployment": m.deployment == nil, "Service": m.service == nil, "ConfigMap": m.config == nil,
		"PodDisruptionBudget": m.pdb == nil, "ServiceMonitor": m.monitor == nil, "PrometheusRule": m.rules == nil,
		"NetworkPolicy": m.policy == nil} {
		if missing {
			t.Fatalf("kustomize output has no %s", name)
		}
	}
	return m
}

// TestManifests checks that the resources agree: selectors select the pods, probes and the
// ServiceMonitor use the metrics port, the configuration comes from the generated ConfigMap and
// the Secret, the grace period covers SHUTDOWN_TIMEOUT, and the pod runs as non-root.
func TestManifests(t *testing.T) {
	m := build(t)
	pod := m.deployment.Spec.Template
	podLabels := labels.Set(pod.Labels)
	sel, err := labelsSelector(m.deployment.Spec.Selector.MatchLabels)
	if err != nil || !sel.Matches(podLabels) {
		t.Errorf("the Deployment's selector %v does not select its pods %v", m.deployment.Spec.Selector.MatchLabels, pod.Labels)
	}
	if !labels.SelectorFromSet(m.service.Spec.Selector).Matches(podLabels) || len(m.service.Spec.Selector) == 0 {
		t.Errorf("the Service's selector %v does not select the pods %v", m.service.Spec.Selector, pod.Labels)
	}
	if m.pdb.Spec.Selector == nil || !labels.SelectorFromSet(m.pdb.Spec.Selector.MatchLabels).Matches(podLabels) {
		t.Errorf("the PodDisruptionBudget does not select the pods %v", pod.Labels)
	}
	if !labels.SelectorFromSet(m.monitor.Spec.Selector.MatchLabels).Matches(labels.Set(m.service.Labels)) {
		t.Errorf("the ServiceMonitor's selector %v does not select the Service %v", m.monitor.Spec.Selector.MatchLabels, m.service.Labels)
	}

	if len(pod.Spec.Containers) != 1 {
		t.Fatalf("%d containers, want 1", len(pod.Spec.Containers))
	}
	c := pod.Spec.Containers[0]
	ports := map[string]int32{}
	for _, p := range c.Ports {
		ports[p.Name] = p.ContainerPort
	}
	if ports["metrics"] != 9090 {
		t.Errorf("container ports %v, want metrics on 9090 (HTTP_ADDR)", ports)
	}
	for name, probe := range map[string]*corev1.Probe{"liveness": c.LivenessProbe, "readiness": c.ReadinessProbe, "startup": c.StartupProbe} {
		want := map[string]string{"liveness": "/healthz", "readiness": "/readyz", "startup": "/healthz"}[name]
		if probe == nil || probe.HTTPGet == nil || probe.HTTPGet.Path != want || probe.HTTPGet.Port.String() != "metrics" {
			t.Errorf("%s probe %+v, want GET %s on the metrics port", name, probe, want)
		}
	}
	// deploy/README.md: the startup probe gives the binary a minute to serve /healthz (every 2 s,
	// 30 failures), and nothing more: it does not wait for Postgres or Kafka.
	if sp := c.StartupProbe; sp != nil {
		readme, err := os.ReadFile("../README.md")
		if err != nil {
			t.Fatal(err)
		}
		window := time.Duration(sp.PeriodSeconds*sp.FailureThreshold) * time.Second
		want := fmt.Sprintf("(every %d s, %d failures: %s for the binary to start serving HTTP)", sp.PeriodSeconds, sp.FailureThreshold,
			map[time.Duration]string{time.Minute: "a minute"}[window])
		if !strings.Contains(strings.Join(strings.Fields(string(readme)), " "), want) {
			t.Errorf("deploy/README.md does not say %q, the startup probe's settings", want)
		}
	}
	if len(m.service.Spec.Ports) != 1 || m.service.Spec.Ports[0].TargetPort.String() != "metrics" || m.monitor.Spec.Endpoints[0].Port != m.service.Spec.Ports[0].Name {
		t.Errorf("Service ports %+v and ServiceMonitor endpoints %+v do not lead to the metrics port", m.service.Spec.Ports, m.monitor.Spec.Endpoints)
	}

	var fromConfig bool
	for _, e := range c.EnvFrom {
		fromConfig = fromConfig || (e.ConfigMapRef != nil && e.ConfigMapRef.Name == m.config.Name)
	}
	if !fromConfig {
		t.Errorf("the container does not take its environment from the generated ConfigMap %s", m.config.Name)
	}
	var dbFromSecret bool
	for _, e := range c.Env {
		if e.Name == "DATABASE_URL" {
			dbFromSecret = e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil
		}
	}
	if !dbFromSecret {
		t.Error("DATABASE_URL must come from a Secret")
	}
	if _, ok := m.config.Data["DATABASE_URL"]; ok {
		t.Error("DATABASE_URL is in the ConfigMap: it holds a password, put it in the Secret")
	}
	for _, required := range []string{"KAFKA_BROKERS", "KAFKA_GROUP_ID", "KAFKA_TOPICS", "HANDLER"} {
		if m.config.Data[required] == "" {
			t.Errorf("the ConfigMap does not set %s", required)
		}
	}

	shutdown := 10 * time.Second
	if v, ok := m.config.Data["SHUTDOWN_TIMEOUT"]; ok {
		if shutdown, err = time.ParseDuration(v); err != nil {
			t.Errorf("SHUTDOWN_TIMEOUT=%q: %v", v, err)
		}
	}
	if grace := pod.Spec.TerminationGracePeriodSeconds; grace == nil || time.Duration(*grace)*time.Second <= shutdown {
		t.Errorf("terminationGracePeriodSeconds must exceed SHUTDOWN_TIMEOUT %v, or Kubernetes kills the drain", shutdown)
	}

	sc := pod.Spec.SecurityContext
	if sc == nil || sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot {
		t.Error("the pod must run as non-root")
	}
	if c.SecurityContext == nil || c.SecurityContext.ReadOnlyRootFilesystem == nil || !*c.SecurityContext.ReadOnlyRootFilesystem {
		t.Error("the container's root filesystem should be read-only")
	}
	if c.Resources.Requests.Cpu().IsZero() || c.Resources.Limits.Memory().IsZero() {
		t.Errorf("resources %+v: want a CPU request and a memory limit", c.Resources)
	}
	// The rest of what deploy/README.md says the base sets.
	if sc == nil || sc.RunAsUser == nil || *sc.RunAsUser != 65532 || sc.SeccompProfile == nil || sc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("pod securityContext %+v: want uid 65532 (distroless nonroot) and the RuntimeDefault seccomp profile", sc)
	}
	if csc := c.SecurityContext; csc == nil || csc.AllowPrivilegeEscalation == nil || *csc.AllowPrivilegeEscalation ||
		csc.Capabilities == nil || !slices.Equal(csc.Capabilities.Drop, []corev1.Capability{"ALL"}) {
		t.Errorf("container securityContext %+v: want no privilege escalation and all capabilities dropped", c.SecurityContext)
	}
	if ru := m.deployment.Spec.Strategy.RollingUpdate; ru == nil || ru.MaxUnavailable.String() != "1" || ru.MaxSurge.String() != "0" {
		t.Errorf("rolling update %+v: want maxUnavailable 1, maxSurge 0 (one rebalance at a time)", ru)
	}
	if u := m.pdb.Spec.MaxUnavailable; u == nil || u.String() != "1" {
		t.Errorf("PodDisruptionBudget maxUnavailable %v, want 1", u)
	}
	for _, e := range c.Env {
		if e.Name == "DATABASE_URL" && e.ValueFrom.SecretKeyRef.Name != "kafkapg-secrets" {
			t.Errorf("DATABASE_URL comes from Secret %q; deploy/README.md tells users to create kafkapg-secrets", e.ValueFrom.SecretKeyRef.Name)
		}
	}
}

// decode renders the kustomization in dir and decodes every resource strictly (a misspelt or
// misplaced field is an error, as the API server's schema would say) into the value target
// returns for its kind; a nil target skips the resource.
func decode(t *testing.T, dir string, target func(kind, name string) any) {
	t.Helper()
	k := krusty.MakeKustomizer(krusty.MakeDefaultOptions())
	rm, err := k.Run(filesys.MakeFsOnDisk(), dir)
	if err != nil {
		t.Fatalf("kustomize build %s: %v", dir, err)
	}
	for _, r := range rm.Resources() {
		into := target(r.GetKind(), r.GetName())
		if into == nil {
			continue
		}
		y, err := r.AsYAML()
		if err != nil {
			t.Fatal(err)
		}
		if err := yaml.UnmarshalStrict(y, into); err != nil {
			t.Errorf("%s %s does not match its schema: %v", r.GetKind(), r.GetName(), err)
		}
	}
}

func labelsSelector(m map[string]string) (labels.Selector, error) {
	if len(m) == 0 {
		return nil, fmt.Errorf("empty selector")
	}
	return labels.SelectorFromSet(m), nil
}

// TestAlertRules runs Prometheus's own rule-file checks (promtool check rules does the same)
// over the PrometheusRule's groups: PromQL parses, templates render, names are valid.
func TestAlertRules(t *testing.T) {
	m := build(t)
	groups, err := yaml.Marshal(map[string]any{"groups": m.rules.Spec.Groups})
	if err != nil {
		t.Fatal(err)
	}
	rg, errs := rulefmt.Parse(groups, false, model.UTF8Validation, parser.NewParser(parser.Options{}), slog.New(slog.DiscardHandler))
	for _, err := range errs {
		t.Errorf("alert rules: %v", err)
	}
	if rg == nil {
		return
	}
	n := 0
	for _, g := range rg.Groups {
		for _, r := range g.Rules {
			n++
			if r.Alert == "" {
				continue
			}
			if r.Labels["severity"] == "" || r.Annotations["summary"] == "" {
				t.Errorf("alert %s needs a severity label and a summary annotation", r.Alert)
			}
		}
	}
	readme, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	documented := regexp.MustCompile("(?m)^\\| `(Kafkapg\\w+)` \\|").FindAllStringSubmatch(string(readme), -1)
	var names, want []string
	for _, g := range rg.Groups {
		for _, r := range g.Rules {
			names = append(names, r.Alert)
		}
	}
	for _, d := range documented {
		want = append(want, d[1])
	}
	slices.Sort(names)
	slices.Sort(want)
	if !slices.Equal(names, want) || n != len(want) {
		t.Errorf("alerts %v; deploy/README.md's table lists %v", names, want)
	}
	for _, g := range rg.Groups {
		for _, r := range g.Rules {
			checkNoSumOfGroupGauges(t, "alert "+r.Alert, r.Expr)
		}
	}
}

// groupGauges are the gauges every replica reports with the same, group-wide value: summing
// them over replicas multiplies them by the replica count.
var groupGauges = regexp.MustCompile(`^kafkapg_(consumer_lag_records|retry_tier_records|retry_tier_lag_seconds|held_keys|blocked_keys|held_records|oldest_held_record_age_seconds|dead_letters_new|dead_letter_oldest_new_seconds)$`)

// checkNoSumOfGroupGauges fails if expr sums a group-wide gauge directly: it must take max (or
// min) over replicas first.
func checkNoSumOfGroupGauges(t *testing.T, what, expr string) {
	t.Helper()
	e, err := parser.NewParser(parser.Options{}).ParseExpr(strings.ReplaceAll(expr, "$__rate_interval", "5m"))
	if err != nil {
		t.Errorf("%s: %v", what, err)
		return
	}
	parser.Inspect(e, func(n parser.Node, _ []parser.Node) error {
		agg, ok := n.(*parser.AggregateExpr)
		if !ok || agg.Op != parser.SUM {
			return nil
		}
		if vs, ok := agg.Expr.(*parser.VectorSelector); ok && groupGauges.MatchString(vs.Name) {
			t.Errorf("%s sums the group-wide gauge %s over replicas; take max by (...) first", what, vs.Name)
		}
		return nil
	})
}

// TestDashboard checks that the Grafana dashboard is valid JSON whose every query parses as
// PromQL.
func TestDashboard(t *testing.T) {
	for _, q := range dashboardQueries(t) {
		checkNoSumOfGroupGauges(t, fmt.Sprintf("dashboard query %q", q), q)
	}
}

func dashboardQueries(t *testing.T) []string {
	t.Helper()
	b, err := os.ReadFile("../grafana/kafkapg-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		Title  string
		Panels []struct {
			Title   string
			Targets []struct{ Expr string }
		}
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	if err := dec.Decode(&d); err != nil {
		t.Fatalf("dashboard: %v", err)
	}
	var out []string
	for _, p := range d.Panels {
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, tg := range p.Targets {
			out = append(out, tg.Expr)
		}
	}
	if len(out) < 10 {
		t.Errorf("dashboard has %d queries", len(out))
	}
	return out
}

// TestAutoscaling builds deploy/keda (the base and a KEDA ScaledObject) and
// checks that the ScaledObject decodes strictly into KEDA's own type, scales the Deployment,
// reads the brokers and the group from the Deployment's configuration, keeps at least one
// replica and stops at the partition count, and that the Deployment leaves its replica count to
// KEDA. Trigger metadata names are checked against the Kafka scaler's (a misspelt one is
// ignored by KEDA, silently).
func TestAutoscaling(t *testing.T) {
	var so *kedav1alpha1.ScaledObject
	var dep *appsv1.Deployment
	var config *corev1.ConfigMap
	decode(t, "../keda", func(kind, _ string) any {
		switch kind {
		case "ScaledObject":
			so = &kedav1alpha1.ScaledObject{}
			return so
		case "Deployment":
			dep = &appsv1.Deployment{}
			return dep
		case "ConfigMap":
			config = &corev1.ConfigMap{}
			return config
		}
		return nil // checked by TestManifests
	})
	if so == nil || dep == nil || config == nil {
		t.Fatalf("kustomize output lacks the ScaledObject, Deployment or ConfigMap")
	}
	if dep.Spec.Replicas != nil {
		t.Errorf("the Deployment sets replicas %d: KEDA's autoscaler owns the count", *dep.Spec.Replicas)
	}
	if so.Spec.ScaleTargetRef == nil || so.Spec.ScaleTargetRef.Name != dep.Name || (so.Spec.ScaleTargetRef.Kind != "" && so.Spec.ScaleTargetRef.Kind != "Deployment") {
		t.Errorf("scaleTargetRef %+v, want the Deployment %s", so.Spec.ScaleTargetRef, dep.Name)
	}
	if so.Spec.MinReplicaCount == nil || *so.Spec.MinReplicaCount < 1 {
		t.Error("minReplicaCount must be at least 1: a replica also publishes the outbox and delivers the retry tiers, which no lag shows")
	}
	if so.Spec.MaxReplicaCount == nil || *so.Spec.MaxReplicaCount < *so.Spec.MinReplicaCount {
		t.Errorf("maxReplicaCount %v: want a bound at or above minReplicaCount", so.Spec.MaxReplicaCount)
	}
	if len(so.Spec.Triggers) != 1 || so.Spec.Triggers[0].Type != "kafka" {
		t.Fatalf("triggers %+v, want one kafka trigger", so.Spec.Triggers)
	}
	md := so.Spec.Triggers[0].Metadata
	known := map[string]bool{}
	for _, name := range []string{"bootstrapServers", "consumerGroup", "topic", "partitionLimitation", "lagThreshold", "activationLagThreshold",
		"offsetResetPolicy", "allowIdleConsumers", "excludePersistentLag", "scaleToZeroOnInvalidOffset", "limitToPartitionsWithLag",
		"ensureEvenDistributionOfPartitions", "fullMetadata", "version", "tls", "unsafeSsl", "sasl", "saslTokenProvider", "awsRegion"} {
		known[name], known[name+"FromEnv"] = true, true
	}
	for name := range md {
		if !known[name] {
			t.Errorf("trigger metadata %q is not a setting of KEDA's Kafka scaler (pkg/scalers/kafka_scaler.go)", name)
		}
	}
	for setting, variable := range map[string]string{"bootstrapServersFromEnv": "KAFKA_BROKERS", "consumerGroupFromEnv": "KAFKA_GROUP_ID"} {
		if md[setting] != variable || config.Data[variable] == "" {
			t.Errorf("trigger %s = %q, want %s, which config.env sets", setting, md[setting], variable)
		}
	}
	if md["allowIdleConsumers"] != "false" {
		t.Errorf("allowIdleConsumers = %q, want false: replicas beyond the partition count own nothing", md["allowIdleConsumers"])
	}
	if md["excludePersistentLag"] != "true" {
		t.Errorf("excludePersistentLag = %q, want true: the lag of a partition an operator paused grows on purpose and must not add replicas", md["excludePersistentLag"])
	}
	if md["topic"] != "" {
		t.Errorf("topic = %q: leave it empty, so that the lag of the retry tiers counts too", md["topic"])
	}
	if lag := md["lagThreshold"]; lag == "" {
		t.Error("lagThreshold is not set (KEDA's default, 10, scales out on a trickle)")
	}
}
