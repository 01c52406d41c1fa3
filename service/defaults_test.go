package service

import (
	"cmp"
	"fmt"
	"go/ast"
	"go/constant"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kafkapg/kafkapg/processor"
)

// A default has one home: processor/config.go's withDefaults, which gives a zero processor.Config
// field its value. Three places repeat it for readers: the variable's `default` tag in
// service/config.go, its row in docs/configuration.md, and the "Defaults to …" of the field's
// comment. The tests here fail when any of them says something else, naming the variable or
// field, both values and the file to fix.

const (
	configDoc           = "../docs/configuration.md"
	processorConfigFile = "../processor/config.go"
)

// describedDefaults are the variables without a default tag whose Default cell describes what
// happens instead (TestDocsHandlerDefaultsToTheOnlyHandler checks it).
var describedDefaults = map[string]string{"HANDLER": "the only handler"}

// runTimeDefaults are the processor.Config fields whose default only exists at run time: their
// comments describe it, and processor's TestConfigWithDefaults checks the first three.
var runTimeDefaults = map[string]bool{"InstanceName": true, "Logger": true, "Registerer": true, "Propagator": true}

// TestDocsVariablesTable: every row of docs/configuration.md's table of variables has four cells;
// every variable the service reads has exactly one row, and no row names another; the Default
// cell is the `default` tag (or says "required" exactly for the variables the service refuses to
// start without, "unset" for the others); the processor.Config cell names the field the variable
// sets, "(inverted)" exactly when the variable is its negation.
func TestDocsVariablesTable(t *testing.T) {
	doc, err := os.ReadFile(configDoc)
	if err != nil {
		t.Fatal(err)
	}
	rows, problems := variablesTable(string(doc))
	for _, p := range problems {
		t.Errorf("docs/configuration.md: %s", p)
	}
	if len(rows) == 0 {
		t.Fatal("docs/configuration.md: no table of variables found under \"## Variables\"")
	}

	required := requiredVars(t)
	setEnv(t, minimal())
	e, err := loadEnv(builtins())
	if err != nil {
		t.Fatalf("the minimal environment does not load: %v", err)
	}
	c := e.processorConfig(builtins(), nil, nil)

	vars := map[string]envVar{}
	for _, v := range envVars() {
		vars[v.name] = v
	}
	rowsOf := map[string]int{}
	for _, r := range rows {
		for _, name := range r.names {
			rowsOf[name]++
			v, ok := vars[name]
			if !ok {
				t.Errorf("docs/configuration.md line %d: %s is not a variable the service reads (service/config.go has no envconfig tag for it)", r.line, name)
				continue
			}
			if msg := docDefaultMismatch(v, r.def, required[name]); msg != "" {
				t.Errorf("docs/configuration.md line %d: %s: %s", r.line, name, msg)
			}
			if want := fieldCell(v, e, c); r.field != want {
				t.Errorf("docs/configuration.md line %d: %s: the processor.Config cell is %q, want %q (service/config.go's field tag)", r.line, name, r.field, want)
			}
		}
	}
	for _, v := range envVars() {
		if rowsOf[v.name] != 1 {
			t.Errorf("docs/configuration.md has %d rows for %s, want 1", rowsOf[v.name], v.name)
		}
	}
}

// TestDocsHandlerDefaultsToTheOnlyHandler: HANDLER's described default.
func TestDocsHandlerDefaultsToTheOnlyHandler(t *testing.T) {
	setEnv(t, with("HANDLER", "<unset>"))
	only, err := newRegistry(builtinHandlers[1:2])
	if err != nil {
		t.Fatal(err)
	}
	e, err := loadEnv(only)
	if err != nil {
		t.Fatalf("without HANDLER, a binary with one handler does not start: %v; docs/configuration.md says the default is %q", err, describedDefaults["HANDLER"])
	}
	if e.Handler != builtinHandlers[1].Name {
		t.Errorf("without HANDLER, a binary whose one handler is %q runs %q; docs/configuration.md says the default is %q",
			builtinHandlers[1].Name, e.Handler, describedDefaults["HANDLER"])
	}
}

// TestDefaultsOfTheEnvironmentAreTheProcessors: each variable that sets a processor.Config field
// has, as its default tag, the processor's own default for a zero field: Go and the environment
// mean the same by "not set". The tag is read the way the service reads it (loadEnv,
// processorConfig), so the inverted variables and RETRY_TIERS are compared as the processor
// sees them.
func TestDefaultsOfTheEnvironmentAreTheProcessors(t *testing.T) {
	defaults := codeDefaults(t)
	setEnv(t, minimal())
	e, err := loadEnv(builtins())
	if err != nil {
		t.Fatalf("the minimal environment does not load: %v", err)
	}
	c := reflect.ValueOf(e.processorConfig(builtins(), nil, nil)).Elem()
	checked := 0
	for _, v := range envVars() {
		if v.field == "" {
			continue
		}
		got := c.FieldByName(v.field)
		if !got.IsValid() {
			t.Errorf("service/config.go: %s has field:%q, which is not a field of processor.Config", v.name, v.field)
			continue
		}
		d := defaults.of(v.field)
		switch {
		case !v.hasDefault && d.expr != "":
			t.Errorf("service/config.go: %s has no default tag, but the processor defaults Config.%s to %s (processor/config.go, withDefaults): give it default:%q",
				v.name, v.field, d.expr, fmt.Sprint(d.value))
		case !v.hasDefault:
			// Required (KAFKA_BROKERS), or described (HANDLER): TestDocsVariablesTable.
		case !d.value.IsValid():
			t.Errorf("processor/config.go: withDefaults sets Config.%s to %s, which only run time knows, yet %s has a default tag", v.field, d.expr, v.name)
		case !reflect.DeepEqual(got.Interface(), d.value.Interface()):
			t.Errorf("%s=%q (its default tag in service/config.go) makes Config.%s %v, but the processor defaults a zero %s to %v (processor/config.go, withDefaults: %s): fix the tag, or the default that is wrong",
				v.name, v.def, v.field, got.Interface(), v.field, d.value.Interface(), cmp.Or(d.expr, "left zero"))
		default:
			checked++
		}
	}
	if checked < 20 {
		t.Errorf("only %d variables' defaults were compared with the processor's; want every variable with a field tag and a default", checked)
	}
}

// TestDefaultsInConfigCommentsAreTheProcessors: the "Defaults to …" of each processor.Config
// field's comment is the value withDefaults gives it, and every field withDefaults sets says so
// in its comment, with or without a variable (HandoffTimeout has none).
func TestDefaultsInConfigCommentsAreTheProcessors(t *testing.T) {
	t.Parallel()
	defaults := codeDefaults(t)
	stated := 0
	for _, f := range defaults.fields {
		name := f.name
		d := defaults.of(name)
		text, says := statedDefault(f.doc)
		switch {
		case runTimeDefaults[name]:
			if !says {
				t.Errorf("processor/config.go: Config.%s's comment no longer says what it defaults to: say it, or drop it from runTimeDefaults", name)
			}
		case !says && d.expr != "":
			t.Errorf("processor/config.go: withDefaults sets Config.%s to %s, but its comment does not say \"Defaults to …\"", name, d.expr)
		case !says:
		case !d.value.IsValid():
			t.Errorf("processor/config.go: withDefaults sets Config.%s to %s, which only run time knows: list it in runTimeDefaults (service/defaults_test.go)", name, d.expr)
		default:
			want, err := readValue(text, f.typ, defaults)
			if err != nil {
				t.Errorf("processor/config.go: Config.%s's comment says it defaults to %q, which this test cannot read as a %s (%v): write the value as 5s, 7 days, 64 MiB, 500, 0.5, \"name\" or a constant's name",
					name, text, f.typ, err)
				continue
			}
			stated++
			if !reflect.DeepEqual(want.Interface(), d.value.Interface()) {
				t.Errorf("processor/config.go: Config.%s's comment says it defaults to %v, but withDefaults gives it %v (%s): fix the comment, or the code if the comment is right",
					name, want.Interface(), d.value.Interface(), cmp.Or(d.expr, "left zero"))
			}
		}
	}
	if stated < 20 {
		t.Errorf("only %d fields' stated defaults were read from processor/config.go; its comments must say \"Defaults to …\"", stated)
	}
}

// TestDocsTableRefusesMalformedRows: the table's reader names a row with a cell too many or too
// few (as the TLS and SASL rows once were, their meaning in the field's column), and a row whose
// first cell names no variable.
func TestDocsTableRefusesMalformedRows(t *testing.T) {
	t.Parallel()
	doc := "## Variables\n\n" +
		"| Variable | Default | `processor.Config` | Meaning |\n|---|---|---|---|\n" +
		"| `A` | `1` | `A` | Fine, with a `|` in code. |\n" +
		"| `KAFKA_TLS_CA_FILE` | | PEM file of the CA(s). | | `KafkaOptions` |\n" +
		"| `B` | `2` | `B` |\n" +
		"| B | `2` | `B` | No backquotes. |\n"
	rows, problems := variablesTable(doc)
	if len(rows) != 1 || rows[0].names[0] != "A" || rows[0].meaning != "Fine, with a `|` in code." {
		t.Errorf("rows = %+v, want the one well-formed row", rows)
	}
	want := []string{"line 6: a row has 5 cells", "line 7: a row has 3 cells", `line 8: the first cell, "B", names no variable`}
	if len(problems) != len(want) {
		t.Fatalf("problems = %q, want %d", problems, len(want))
	}
	for i, w := range want {
		if !strings.HasPrefix(problems[i], w) {
			t.Errorf("problem %d = %q, want it to start with %q", i, problems[i], w)
		}
	}
}

// TestDefaultsDocCellIsStrict: the Default cell's rules, on cells that must fail.
func TestDefaultsDocCellIsStrict(t *testing.T) {
	t.Parallel()
	size := envVar{name: "MAX_BUFFERED_BYTES", def: "67108864", hasDefault: true, typ: reflect.TypeFor[int]()}
	days := envVar{name: "IDEMPOTENCY_RETENTION", def: "168h", hasDefault: true, typ: reflect.TypeFor[time.Duration]()}
	untagged := envVar{name: "TRACE_URL", typ: reflect.TypeFor[string]()}
	for _, tt := range []struct {
		v        envVar
		cell     string
		required bool
		ok       bool
	}{
		{size, "`67108864` (64 MiB)", false, true},
		{size, "`67108864`", false, true},
		{size, "`67108864` (32 MiB)", false, false},
		{size, "`33554432` (64 MiB)", false, false},
		{size, "64 MiB", false, false},
		{size, "unset", false, false},
		{days, "`168h` (7 days)", false, true},
		{days, "`168h` (a week)", false, false},
		{untagged, "unset", false, true},
		{untagged, "unset (off)", false, true},
		{untagged, "", false, false},
		{untagged, "required", false, false},
		{untagged, "unset", true, false},
		{untagged, "required", true, true},
		{untagged, "`x`", false, false},
	} {
		if msg := docDefaultMismatch(tt.v, tt.cell, tt.required); (msg == "") != tt.ok {
			t.Errorf("%s (default %q, required %v), cell %q: mismatch %q, want ok %v", tt.v.name, tt.v.def, tt.required, tt.cell, msg, tt.ok)
		}
	}
}

// envVar is a variable of env, as its tags describe it.
type envVar struct {
	name       string
	def        string // the default tag
	hasDefault bool
	field      string // the processor.Config field it sets (field tag), if any
	kafkaOpt   bool   // a kafkaSecurityEnv variable: it makes Config.KafkaOptions
	index      []int  // its field in env
	typ        reflect.Type
}

// envVars returns the variables of env, those of its embedded structs included.
func envVars() []envVar {
	var out []envVar
	var walk func(t reflect.Type, index []int, kafka bool)
	walk = func(t reflect.Type, index []int, kafka bool) {
		for i := range t.NumField() {
			f := t.Field(i)
			idx := append(slices.Clone(index), i)
			if f.Anonymous {
				walk(f.Type, idx, f.Type == reflect.TypeFor[kafkaSecurityEnv]())
				continue
			}
			if name := f.Tag.Get("envconfig"); name != "" {
				def, has := f.Tag.Lookup("default")
				out = append(out, envVar{name: name, def: def, hasDefault: has, field: f.Tag.Get("field"), kafkaOpt: kafka, index: idx, typ: f.Type})
			}
		}
	}
	walk(reflect.TypeFor[env](), nil, false)
	return out
}

// requiredVars returns the variables the service does not start without: those of the minimal
// environment whose absence loadEnv reports as "<name> is required".
func requiredVars(t *testing.T) map[string]bool {
	out := map[string]bool{}
	for name := range minimal() {
		setEnv(t, with(name, "<unset>"))
		if _, err := loadEnv(builtins()); err != nil && strings.Contains(err.Error(), name+" is required") {
			out[name] = true
		}
	}
	if len(out) == 0 {
		t.Fatal("no variable of the minimal environment is required: the environment does not load as this test expects")
	}
	return out
}

// fieldCell is what the processor.Config cell of v's row must say: the field v sets, inverted if
// the default environment (e, making c) gives the field the opposite of v's value.
func fieldCell(v envVar, e *env, c *processor.Config) string {
	switch {
	case v.kafkaOpt:
		return "`KafkaOptions`"
	case v.field == "":
		return ""
	}
	got := reflect.ValueOf(c).Elem().FieldByName(v.field)
	set := reflect.ValueOf(e).Elem().FieldByIndex(v.index)
	if got.IsValid() && got.Kind() == reflect.Bool && set.Kind() == reflect.Bool && got.Bool() != set.Bool() {
		return "`" + v.field + "` (inverted)"
	}
	return "`" + v.field + "`"
}

var (
	tagged      = regexp.MustCompile("^`([^`]*)`(?: \\((.+)\\))?$")
	unsetCell   = regexp.MustCompile(`^unset(?: \(.+\))?$`)
	bytesText   = regexp.MustCompile(`^(\d+) (KiB|MiB|GiB)$`)
	daysText    = regexp.MustCompile(`^(\d+) days?$`)
	namesCell   = regexp.MustCompile("^`[A-Z][A-Z0-9_]*`(?: / `[A-Z][A-Z0-9_]*`)*$")
	nameInCell  = regexp.MustCompile("`([A-Z][A-Z0-9_]*)`")
	tableHeader = []string{"Variable", "Default", "`processor.Config`", "Meaning"}
)

// docDefaultMismatch says how cell, the Default cell of v's row, disagrees with v; "" if it
// agrees. A variable with a default tag shows the tag in backquotes, optionally followed by the
// same value in other words: "`67108864` (64 MiB)", "`168h` (7 days)". One without says
// "required" if the service requires it, its described default, or "unset".
func docDefaultMismatch(v envVar, cell string, required bool) string {
	if !v.hasDefault {
		switch want, described := describedDefaults[v.name]; {
		case described && cell != want:
			return fmt.Sprintf("the Default cell is %q, want %q", cell, want)
		case described:
		case required && cell != "required":
			return fmt.Sprintf("the Default cell is %q, but the service refuses to start without it: want \"required\"", cell)
		case !required && !unsetCell.MatchString(cell):
			return fmt.Sprintf("the Default cell is %q, but it has no default tag (service/config.go) and is not required: want \"unset\" or \"unset (what that means)\"", cell)
		}
		return ""
	}
	m := tagged.FindStringSubmatch(cell)
	switch {
	case m == nil:
		return fmt.Sprintf("the Default cell is %q, want `%s` (the default tag in service/config.go), backquoted", cell, v.def)
	case m[1] != v.def:
		return fmt.Sprintf("docs/configuration.md says the default is %q, service/config.go's default tag says %q: fix the one that is wrong", m[1], v.def)
	case m[2] == "":
		return ""
	}
	// A restatement in words must be the same value.
	if b := bytesText.FindStringSubmatch(m[2]); b != nil && v.typ.Kind() == reflect.Int {
		n, _ := strconv.Atoi(b[1])
		n <<= map[string]int{"KiB": 10, "MiB": 20, "GiB": 30}[b[2]]
		if tag, err := strconv.Atoi(v.def); err != nil || tag != n {
			return fmt.Sprintf("the Default cell restates `%s` as %q, which is %d", v.def, m[2], n)
		}
		return ""
	}
	if d := daysText.FindStringSubmatch(m[2]); d != nil && v.typ == reflect.TypeFor[time.Duration]() {
		n, _ := strconv.Atoi(d[1])
		if tag, err := time.ParseDuration(v.def); err != nil || tag != time.Duration(n)*24*time.Hour {
			return fmt.Sprintf("the Default cell restates `%s` as %q, which is %v", v.def, m[2], time.Duration(n)*24*time.Hour)
		}
		return ""
	}
	return fmt.Sprintf("the Default cell restates `%s` as %q, which this test cannot read (write e.g. 64 MiB, 7 days)", v.def, m[2])
}

// docRow is a row of docs/configuration.md's table of variables.
type docRow struct {
	line                int
	names               []string
	def, field, meaning string
}

// variablesTable reads the table under "## Variables" in doc: its rows, and what is wrong with
// those it cannot read.
func variablesTable(doc string) (rows []docRow, problems []string) {
	lines := strings.Split(doc, "\n")
	start := slices.Index(lines, "## Variables")
	if start < 0 {
		return nil, []string{`no "## Variables" section`}
	}
	i := start + 1
	for i < len(lines) && !strings.HasPrefix(lines[i], "|") {
		i++
	}
	if i+1 >= len(lines) {
		return nil, []string{"no table under \"## Variables\""}
	}
	if head, _ := cells(lines[i]); !slices.Equal(head, tableHeader) {
		problems = append(problems, fmt.Sprintf("line %d: the table's header is %q, want %q", i+1, head, tableHeader))
	}
	for i += 2; i < len(lines) && strings.HasPrefix(lines[i], "|"); i++ {
		cs, ok := cells(lines[i])
		switch {
		case !ok || len(cs) != len(tableHeader):
			problems = append(problems, fmt.Sprintf("line %d: a row has %d cells, want %d (%s): %q", i+1, len(cs), len(tableHeader), strings.Join(tableHeader, " | "), lines[i]))
		case !namesCell.MatchString(cs[0]):
			problems = append(problems, fmt.Sprintf("line %d: the first cell, %q, names no variable (want `NAME`, or `A` / `B`)", i+1, cs[0]))
		case cs[3] == "":
			problems = append(problems, fmt.Sprintf("line %d: %s has no meaning", i+1, cs[0]))
		default:
			r := docRow{line: i + 1, def: cs[1], field: cs[2], meaning: cs[3]}
			for _, m := range nameInCell.FindAllStringSubmatch(cs[0], -1) {
				r.names = append(r.names, m[1])
			}
			rows = append(rows, r)
		}
	}
	return rows, problems
}

// cells splits a Markdown table row into its cells, trimmed; a '|' inside backquotes is text.
func cells(line string) ([]string, bool) {
	line = strings.TrimSpace(line)
	if len(line) < 2 || !strings.HasPrefix(line, "|") || !strings.HasSuffix(line, "|") {
		return nil, false
	}
	var out []string
	var cur strings.Builder
	code := false
	for _, r := range line[1 : len(line)-1] {
		switch {
		case r == '`':
			code = !code
			cur.WriteRune(r)
		case r == '|' && !code:
			out = append(out, strings.TrimSpace(cur.String()))
			cur.Reset()
		default:
			cur.WriteRune(r)
		}
	}
	return append(out, strings.TrimSpace(cur.String())), true
}

// configField is a field of processor.Config as processor/config.go declares it.
type configField struct {
	name string
	doc  string // its comment, on one line
	typ  reflect.Type
}

// processorDefaults is what processor/config.go says about defaults: each field's comment, and
// the expression withDefaults assigns to each field it defaults.
type processorDefaults struct {
	fields []configField
	exprs  map[string]ast.Expr // by field
	consts map[string]ast.Expr // the processor package's constants
	fset   *token.FileSet
	memo   map[string]codeDefault
}

// codeDefault is what withDefaults gives a zero field.
type codeDefault struct {
	expr  string        // the expression it assigns, as written; "" if it leaves the field zero
	value reflect.Value // of the field's type; invalid if only run time knows it (a hostname)
}

// codeDefaults reads processor/config.go (and the processor package's constants).
func codeDefaults(t *testing.T) *processorDefaults {
	t.Helper()
	d := &processorDefaults{exprs: map[string]ast.Expr{}, consts: map[string]ast.Expr{}, fset: token.NewFileSet(), memo: map[string]codeDefault{}}
	files, err := filepath.Glob(filepath.Join(filepath.Dir(processorConfigFile), "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	var config *ast.File
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(d.fset, name, nil, parser.ParseComments)
		if err != nil {
			t.Fatal(err)
		}
		if filepath.Base(name) == filepath.Base(processorConfigFile) {
			config = f
		}
		for _, decl := range f.Decls {
			if g, ok := decl.(*ast.GenDecl); ok && g.Tok == token.CONST {
				for _, s := range g.Specs {
					if vs := s.(*ast.ValueSpec); len(vs.Values) == len(vs.Names) {
						for i, n := range vs.Names {
							d.consts[n.Name] = vs.Values[i]
						}
					}
				}
			}
		}
	}
	if config == nil {
		t.Fatalf("%s not found", processorConfigFile)
	}
	configType := reflect.TypeFor[processor.Config]()
	var withDefaults *ast.FuncDecl
	ast.Inspect(config, func(n ast.Node) bool {
		switch n := n.(type) {
		case *ast.TypeSpec:
			st, ok := n.Type.(*ast.StructType)
			if n.Name.Name != "Config" || !ok {
				return false
			}
			for _, f := range st.Fields.List {
				for _, name := range f.Names {
					sf, _ := configType.FieldByName(name.Name)
					d.fields = append(d.fields, configField{name: name.Name, doc: strings.Join(strings.Fields(f.Doc.Text()), " "), typ: sf.Type})
				}
			}
			return false
		case *ast.FuncDecl:
			if n.Name.Name == "withDefaults" && n.Recv != nil {
				withDefaults = n
			}
			return false
		}
		return true
	})
	if len(d.fields) == 0 || withDefaults == nil {
		t.Fatalf("%s: no Config struct or no withDefaults method found", processorConfigFile)
	}
	// Each default is `if out.F == <zero> { … out.F = <default> … }`.
	for _, s := range withDefaults.Body.List {
		is, ok := s.(*ast.IfStmt)
		if !ok {
			continue
		}
		cond, ok := is.Cond.(*ast.BinaryExpr)
		var field string
		if ok && cond.Op == token.EQL {
			field, ok = selector(cond.X)
		}
		if !ok {
			t.Errorf("%s: withDefaults has an if statement this test cannot read (want `if out.Field == zero`): %s", processorConfigFile, d.text(is.Cond))
			continue
		}
		for _, s := range is.Body.List {
			if as, ok := s.(*ast.AssignStmt); ok && len(as.Lhs) == 1 {
				if f, ok := selector(as.Lhs[0]); ok && f == field {
					d.exprs[field] = as.Rhs[0]
				}
			}
		}
		if d.exprs[field] == nil {
			t.Errorf("%s: withDefaults tests whether Config.%s is zero, but sets it nowhere in that if", processorConfigFile, field)
		}
	}
	return d
}

// selector returns F of out.F.
func selector(e ast.Expr) (string, bool) {
	s, ok := e.(*ast.SelectorExpr)
	if !ok {
		return "", false
	}
	if _, ok := s.X.(*ast.Ident); !ok {
		return "", false
	}
	return s.Sel.Name, true
}

// text returns e as written in its file.
func (d *processorDefaults) text(e ast.Expr) string {
	start, end := d.fset.Position(e.Pos()), d.fset.Position(e.End())
	src, err := os.ReadFile(start.Filename)
	if err != nil || end.Offset > len(src) {
		return fmt.Sprintf("(%T at %s)", e, start)
	}
	return string(src[start.Offset:end.Offset])
}

// of returns the default withDefaults gives field.
func (d *processorDefaults) of(field string) codeDefault {
	if cd, ok := d.memo[field]; ok {
		return cd
	}
	sf, ok := reflect.TypeFor[processor.Config]().FieldByName(field)
	if !ok {
		return codeDefault{}
	}
	expr := d.exprs[field]
	if expr == nil {
		return codeDefault{value: reflect.Zero(sf.Type)}
	}
	cd := codeDefault{expr: d.text(expr)}
	if v, err := d.eval(expr); err == nil {
		if rv, err := asType(v, sf.Type); err == nil {
			cd.value = rv
		}
	}
	d.memo[field] = cd
	return cd
}

// runTimeVars are the processor's exported variables a default may name.
var runTimeVars = map[string]any{"DefaultRetryTiers": processor.DefaultRetryTiers}

var timeUnits = map[string]time.Duration{
	"Nanosecond": time.Nanosecond, "Microsecond": time.Microsecond, "Millisecond": time.Millisecond,
	"Second": time.Second, "Minute": time.Minute, "Hour": time.Hour,
}

// eval evaluates a default's expression: constants, time units, other fields' defaults (out.F),
// min and max, the processor's constants and runTimeVars. Anything else (a call) is known only
// at run time.
func (d *processorDefaults) eval(e ast.Expr) (any, error) {
	switch e := e.(type) {
	case *ast.BasicLit:
		return constant.MakeFromLiteral(e.Value, e.Kind, 0), nil
	case *ast.ParenExpr:
		return d.eval(e.X)
	case *ast.Ident:
		if v, ok := runTimeVars[e.Name]; ok {
			return v, nil
		}
		if c, ok := d.consts[e.Name]; ok {
			return d.eval(c)
		}
		return nil, fmt.Errorf("%s is not a constant", e.Name)
	case *ast.SelectorExpr:
		if x, ok := e.X.(*ast.Ident); ok && x.Name == "time" {
			if u, ok := timeUnits[e.Sel.Name]; ok {
				return constant.MakeInt64(int64(u)), nil
			}
		}
		if f, ok := selector(e); ok {
			cd := d.of(f)
			if !cd.value.IsValid() {
				return nil, fmt.Errorf("%s is known only at run time", f)
			}
			return constantOf(cd.value), nil
		}
	case *ast.BinaryExpr:
		x, err := d.constant(e.X)
		if err != nil {
			return nil, err
		}
		y, err := d.constant(e.Y)
		if err != nil {
			return nil, err
		}
		switch e.Op {
		case token.SHL, token.SHR:
			s, ok := constant.Uint64Val(y)
			if !ok {
				return nil, fmt.Errorf("shift by %v", y)
			}
			return constant.Shift(x, e.Op, uint(s)), nil
		case token.QUO:
			if x.Kind() == constant.Int && y.Kind() == constant.Int {
				return constant.BinaryOp(x, token.QUO_ASSIGN, y), nil // integer division, as Go's
			}
		}
		return constant.BinaryOp(x, e.Op, y), nil
	case *ast.CallExpr:
		if f, ok := e.Fun.(*ast.Ident); ok && (f.Name == "min" || f.Name == "max") && len(e.Args) > 0 {
			var best constant.Value
			for _, a := range e.Args {
				v, err := d.constant(a)
				if err != nil {
					return nil, err
				}
				if best == nil || (f.Name == "max" && constant.Compare(v, token.GTR, best)) || (f.Name == "min" && constant.Compare(v, token.LSS, best)) {
					best = v
				}
			}
			return best, nil
		}
	}
	return nil, fmt.Errorf("%s is known only at run time", d.text(e))
}

func (d *processorDefaults) constant(e ast.Expr) (constant.Value, error) {
	v, err := d.eval(e)
	if err != nil {
		return nil, err
	}
	c, ok := v.(constant.Value)
	if !ok || c.Kind() == constant.Unknown {
		return nil, fmt.Errorf("%s is not a constant", d.text(e))
	}
	return c, nil
}

// asType converts an evaluated default to a value of type t.
func asType(v any, t reflect.Type) (reflect.Value, error) {
	out := reflect.New(t).Elem()
	if c, ok := v.(constant.Value); ok {
		switch t.Kind() {
		case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
			i, exact := constant.Int64Val(constant.ToInt(c))
			if constant.ToInt(c).Kind() != constant.Int || !exact || out.OverflowInt(i) {
				return out, fmt.Errorf("%v is not a %s", c, t)
			}
			out.SetInt(i)
		case reflect.Float64:
			f, _ := constant.Float64Val(constant.ToFloat(c))
			out.SetFloat(f)
		case reflect.String:
			if c.Kind() != constant.String {
				return out, fmt.Errorf("%v is not a %s", c, t)
			}
			out.SetString(constant.StringVal(c))
		case reflect.Bool:
			if c.Kind() != constant.Bool {
				return out, fmt.Errorf("%v is not a %s", c, t)
			}
			out.SetBool(constant.BoolVal(c))
		default:
			return out, fmt.Errorf("a constant cannot be a %s", t)
		}
		return out, nil
	}
	rv := reflect.ValueOf(v)
	if rv.Type() != t {
		return out, fmt.Errorf("%v is a %s, not a %s", v, rv.Type(), t)
	}
	return rv, nil
}

var statedRE = regexp.MustCompile(`(?i)\bdefaults? to (.*)`)

// statedDefault returns what a field's comment says it defaults to, from "Defaults to" on.
func statedDefault(doc string) (string, bool) {
	m := statedRE.FindStringSubmatch(doc)
	if m == nil {
		return "", false
	}
	return m[1], true
}

var (
	durationRE  = `(?:\d+(?:\.\d+)?(?:ns|us|µs|ms|s|m|h))+`
	statedDur   = regexp.MustCompile(`^(` + durationRE + `)\b`)
	statedDays  = regexp.MustCompile(`^(\d+) days?\b`)
	statedDurs  = regexp.MustCompile(`^(` + durationRE + `(?:, ` + durationRE + `)*)\b`)
	statedZero  = regexp.MustCompile(`^\((-?\d+)\)`)
	statedBytes = regexp.MustCompile(`^(\d+) (KiB|MiB|GiB)\b`)
	statedInt   = regexp.MustCompile(`^(-?\d+)\b`)
	statedFloat = regexp.MustCompile(`^(\d+(?:\.\d+)?)\b`)
	statedQuote = regexp.MustCompile(`^"([^"]*)"`)
	statedConst = regexp.MustCompile(`^([A-Z][A-Za-z0-9]*)\b`)
	statedBool  = regexp.MustCompile(`^(true|false)\b`)
)

// readValue reads the value at the start of text (what follows "Defaults to") as a t.
func readValue(text string, t reflect.Type, d *processorDefaults) (reflect.Value, error) {
	out := reflect.New(t).Elem()
	switch {
	case t == reflect.TypeFor[time.Duration]():
		if m := statedDays.FindStringSubmatch(text); m != nil {
			n, _ := strconv.Atoi(m[1])
			out.SetInt(int64(time.Duration(n) * 24 * time.Hour))
			return out, nil
		}
		if m := statedDur.FindStringSubmatch(text); m != nil {
			v, err := time.ParseDuration(m[1])
			out.SetInt(int64(v))
			return out, err
		}
	case t == reflect.TypeFor[[]time.Duration]():
		if m := statedDurs.FindStringSubmatch(text); m != nil {
			var ds []time.Duration
			for _, s := range strings.Split(m[1], ", ") {
				v, err := time.ParseDuration(s)
				if err != nil {
					return out, err
				}
				ds = append(ds, v)
			}
			return reflect.ValueOf(ds), nil
		}
	case out.CanInt():
		if m := statedBytes.FindStringSubmatch(text); m != nil {
			n, _ := strconv.ParseInt(m[1], 10, 64)
			out.SetInt(n << map[string]int{"KiB": 10, "MiB": 20, "GiB": 30}[m[2]])
			return out, nil
		}
		for _, re := range []*regexp.Regexp{statedZero, statedInt} {
			if m := re.FindStringSubmatch(text); m != nil {
				n, err := strconv.ParseInt(m[1], 10, 64)
				out.SetInt(n)
				return out, err
			}
		}
	case t.Kind() == reflect.Float64:
		if m := statedFloat.FindStringSubmatch(text); m != nil {
			f, err := strconv.ParseFloat(m[1], 64)
			out.SetFloat(f)
			return out, err
		}
	case t.Kind() == reflect.String:
		if m := statedQuote.FindStringSubmatch(text); m != nil {
			out.SetString(m[1])
			return out, nil
		}
		if m := statedConst.FindStringSubmatch(text); m != nil {
			c, ok := d.consts[m[1]]
			if !ok {
				return out, fmt.Errorf("%s is not a constant of package processor", m[1])
			}
			v, err := d.eval(c)
			if err != nil {
				return out, err
			}
			return asType(v, t)
		}
	case t.Kind() == reflect.Bool:
		if m := statedBool.FindStringSubmatch(text); m != nil {
			out.SetBool(m[1] == "true")
			return out, nil
		}
	}
	return out, fmt.Errorf("no %s at the start of %q", t, text)
}

// constantOf is v, a number, string or boolean, as a constant.
func constantOf(v reflect.Value) constant.Value {
	switch {
	case v.CanInt():
		return constant.MakeInt64(v.Int())
	case v.CanFloat():
		return constant.MakeFloat64(v.Float())
	case v.Kind() == reflect.String:
		return constant.MakeString(v.String())
	case v.Kind() == reflect.Bool:
		return constant.MakeBool(v.Bool())
	}
	return constant.MakeUnknown()
}
