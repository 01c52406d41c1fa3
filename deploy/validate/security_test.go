package validate

import (
	"os"
	"regexp"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/yaml"
)

// TestHardening checks what docs/operations.md's Security section says the base does beyond the
// securityContext: only Prometheus may reach the metrics port, the pod carries no Kubernetes API
// token, and the image is a release, not latest.
func TestHardening(t *testing.T) {
	m := build(t)
	pod := m.deployment.Spec.Template
	if a := pod.Spec.AutomountServiceAccountToken; a == nil || *a {
		t.Error("automountServiceAccountToken: want false (kafkapg never calls the Kubernetes API)")
	}
	if e := pod.Spec.EnableServiceLinks; e == nil || *e {
		t.Error("enableServiceLinks: want false")
	}

	p := m.policy.Spec
	sel := labels.SelectorFromSet(p.PodSelector.MatchLabels)
	if len(p.PodSelector.MatchLabels) == 0 || len(p.PodSelector.MatchExpressions) > 0 || !sel.Matches(labels.Set(pod.Labels)) {
		t.Errorf("the NetworkPolicy's podSelector %+v does not select exactly kafkapg's pods %v", p.PodSelector, pod.Labels)
	}
	if !sel.Matches(labels.Set(m.deployment.Spec.Selector.MatchLabels)) {
		t.Errorf("the NetworkPolicy's podSelector %v is wider than the Deployment's %v", p.PodSelector.MatchLabels, m.deployment.Spec.Selector.MatchLabels)
	}
	var ingress bool
	for _, pt := range p.PolicyTypes {
		ingress = ingress || pt == "Ingress"
	}
	if !ingress || len(p.Ingress) == 0 {
		t.Fatalf("the NetworkPolicy %+v does not restrict ingress", p)
	}
	for i, rule := range p.Ingress {
		if len(rule.From) == 0 {
			t.Errorf("ingress rule %d admits every source: name Prometheus's", i)
		}
		for _, from := range rule.From {
			if from.IPBlock != nil {
				t.Errorf("ingress rule %d admits addresses %v: the metrics port must not leave the cluster", i, from.IPBlock)
			}
			// kustomize's labels (includeSelectors) rewrite a peer's matchLabels into kafkapg's
			// own: a peer that selects kafkapg's pods is that rewrite, not Prometheus.
			if ps := from.PodSelector; ps != nil && len(ps.MatchLabels) > 0 && labels.SelectorFromSet(ps.MatchLabels).Matches(labels.Set(pod.Labels)) {
				t.Errorf("ingress rule %d's podSelector %v selects kafkapg itself (kustomize's labels rewrote it?)", i, ps.MatchLabels)
			}
			if from.PodSelector == nil && from.NamespaceSelector != nil && len(from.NamespaceSelector.MatchLabels) == 0 && len(from.NamespaceSelector.MatchExpressions) == 0 {
				t.Errorf("ingress rule %d admits every namespace", i)
			}
		}
		if len(rule.Ports) != 1 || rule.Ports[0].Port == nil || rule.Ports[0].Port.String() != "metrics" {
			t.Errorf("ingress rule %d's ports %+v: want only the metrics port", i, rule.Ports)
		}
	}

	c := pod.Spec.Containers[0]
	if c.ImagePullPolicy != corev1.PullIfNotPresent {
		t.Errorf("imagePullPolicy %s, want IfNotPresent (the tag is a release)", c.ImagePullPolicy)
	}
	image, tag, _ := strings.Cut(c.Image, ":")
	changelog, err := os.ReadFile("../../CHANGELOG.md")
	if err != nil {
		t.Fatal(err)
	}
	newest := regexp.MustCompile(`(?m)^## (v\d+\.\d+\.\d+)`).FindStringSubmatch(string(changelog))
	if newest == nil {
		t.Fatal("CHANGELOG.md names no release")
	}
	if tag != newest[1] {
		t.Errorf("image %s: want the newest release in CHANGELOG.md, %s:%s", c.Image, image, newest[1])
	}
}

// TestComposePublishesOnLoopback checks that the compose file, whose passwords are in it and
// whose Kafka has no login, publishes nothing beyond the machine it runs on.
func TestComposePublishesOnLoopback(t *testing.T) {
	b, err := os.ReadFile("../compose/docker-compose.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var compose struct {
		Services map[string]struct {
			Ports []string `json:"ports"`
		} `json:"services"`
	}
	if err := yaml.Unmarshal(b, &compose); err != nil {
		t.Fatal(err)
	}
	var n int
	for name, s := range compose.Services {
		for _, p := range s.Ports {
			n++
			if !strings.HasPrefix(p, "127.0.0.1:") {
				t.Errorf("service %s publishes %q on every interface: write 127.0.0.1:%s", name, p, p)
			}
		}
	}
	if n == 0 {
		t.Error("the compose file publishes no port: the test reads it wrongly")
	}
}
