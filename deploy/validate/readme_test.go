package validate

import (
	"fmt"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"

	kedav1alpha1 "github.com/kedacore/keda/v2/apis/keda/v1alpha1"
	appsv1 "k8s.io/api/apps/v1"
	"sigs.k8s.io/yaml"
)

// readme is deploy/README.md with its lines joined, so that a phrase may wrap.
func readme(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	return strings.Join(strings.Fields(string(b)), " ")
}

// says fails t unless deploy/README.md says phrase (whitespace aside), naming where the number
// in it comes from.
func says(t *testing.T, doc, phrase, from string) {
	t.Helper()
	if !strings.Contains(doc, strings.Join(strings.Fields(phrase), " ")) {
		t.Errorf("deploy/README.md does not say %q, as %s has it", phrase, from)
	}
}

// TestReadmeTellsTheManifests: the numbers deploy/README.md gives of the resources, the KEDA
// scaler, the Dockerfile and the compose file are the files' own (the docs' second audit found
// none of them checked).
func TestReadmeTellsTheManifests(t *testing.T) {
	doc := readme(t)

	m := build(t)
	c := m.deployment.Spec.Template.Spec.Containers[0]
	mib := func(q string) string { return strings.TrimSuffix(q, "Mi") + " MiB" }
	says(t, doc, fmt.Sprintf("A request of %s CPU and %s, a %s limit", c.Resources.Requests.Cpu(), mib(c.Resources.Requests.Memory().String()),
		mib(c.Resources.Limits.Memory().String())), "deployment.yaml's resources")
	if uid := m.deployment.Spec.Template.Spec.SecurityContext.RunAsUser; uid == nil {
		t.Error("the pod sets no runAsUser")
	} else {
		says(t, doc, fmt.Sprintf("Non-root (%d)", *uid), "deployment.yaml's runAsUser")
	}

	var so *kedav1alpha1.ScaledObject
	decode(t, "../keda", func(kind, _ string) any {
		if kind == "ScaledObject" {
			so = &kedav1alpha1.ScaledObject{}
			return so
		}
		if kind == "Deployment" {
			return &appsv1.Deployment{}
		}
		return nil
	})
	if so == nil {
		t.Fatal("deploy/keda has no ScaledObject")
	}
	lag, err := strconv.Atoi(so.Spec.Triggers[0].Metadata["lagThreshold"])
	if err != nil {
		t.Fatalf("lagThreshold: %v", err)
	}
	says(t, doc, fmt.Sprintf("adds a replica per %s records of lag (`lagThreshold`)", thousands(lag)), "scaledobject.yaml's lagThreshold")
	says(t, doc, fmt.Sprintf("`maxReplicaCount` (%d)", *so.Spec.MaxReplicaCount), "scaledobject.yaml")
	// "Scale-in is slow (one replica per two minutes after five quiet ones)".
	down := so.Spec.Advanced.HorizontalPodAutoscalerConfig.Behavior.ScaleDown
	if len(down.Policies) != 1 || down.Policies[0].Value != 1 || down.Policies[0].PeriodSeconds != 120 ||
		down.StabilizationWindowSeconds == nil || *down.StabilizationWindowSeconds != 300 {
		t.Errorf("scaleDown %+v: the README says one replica per two minutes after five quiet ones", down)
	}
	says(t, doc, "one replica per two minutes after five quiet ones", "scaledobject.yaml's scaleDown")

	dockerfile, err := os.ReadFile("../Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	base := regexp.MustCompile(`(?m)^FROM (\S+)\s*$`).FindAllStringSubmatch(string(dockerfile), -1)
	if len(base) == 0 {
		t.Fatal("the Dockerfile has no final FROM")
	}
	says(t, doc, fmt.Sprintf("on `%s`", base[len(base)-1][1]), "the Dockerfile's final FROM")
	for _, flag := range []string{"CGO_ENABLED=0", "-trimpath"} {
		if !strings.Contains(string(dockerfile), flag) {
			t.Errorf("the Dockerfile does not build with %s, which the README says", flag)
		}
		says(t, doc, "`"+flag+"`", "the Dockerfile's build")
	}

	b, err := os.ReadFile("../compose/docker-compose.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var compose struct {
		Services map[string]struct {
			Image string `json:"image"`
		} `json:"services"`
	}
	if err := yaml.Unmarshal(b, &compose); err != nil {
		t.Fatal(err)
	}
	images := map[string]bool{}
	for _, s := range compose.Services {
		if s.Image != "" {
			images[s.Image] = true
		}
	}
	for _, prefix := range []string{"apache/kafka:", "postgres:"} {
		n := 0
		for image := range images {
			if strings.HasPrefix(image, prefix) {
				n++
				says(t, doc, "`"+image+"`", "the compose file")
			}
		}
		if n != 1 {
			t.Errorf("the compose file runs %d %s images: want one, which the README names", n, prefix)
		}
	}
}

// TestManifestCommentsCountConnectionsAsTheReadmeDoes: a replica opens its pool's DB_MAX_CONNS
// connections and one more (deploy/README.md, Scaling; service's
// TestDeployReadmeCountsEveryConnection finds them all); the manifests' comments that budget
// connections say so too (two said DB_MAX_CONNS alone).
func TestManifestCommentsCountConnectionsAsTheReadmeDoes(t *testing.T) {
	for _, f := range []string{"../kubernetes/deployment.yaml", "../keda/scaledobject.yaml"} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		text := strings.Join(strings.Fields(string(b)), " ")
		for _, m := range regexp.MustCompile(`x \(?DB_MAX_CONNS[^.:]*`).FindAllString(text, -1) {
			if !strings.HasPrefix(m, "x (DB_MAX_CONNS + 1)") {
				t.Errorf("%s budgets %q: a replica opens DB_MAX_CONNS + 1 connections", f, m)
			}
		}
		if !strings.Contains(text, "x (DB_MAX_CONNS + 1)") {
			t.Errorf("%s does not budget replicas x (DB_MAX_CONNS + 1) connections", f)
		}
	}
}

// thousands writes n with commas, as the docs do: 10,000.
func thousands(n int) string {
	s := strconv.Itoa(n)
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	return s
}
